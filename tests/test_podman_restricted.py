"""The chart's Pod Security "restricted" settings, run: the sidecar shape's two containers started in podman with the
rendered securityContext (tests/podman/transforms.py changes none of it), as the kernel then sees them.

memwatch: uid 10001, no capability in any set, no new privileges, seccomp filtering, a read-only root with a
writable /tmp (the chart's emptyDir); vLLM's stand-in: uid 1000 with the pod's fsGroup among its groups, the same
empty capability sets, and its rings stored by memwatch through that group. And the chart's default, vLLM left as
its image's root: with no capability at all (no DAC_OVERRIDE) it still writes its rings, through the same group."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helm_chart import template
from podman.fixtures import Setup, engine_spec, manifest, set_env, setup, write_timings
from podman.pods import Played, wait_for
from podman.transforms import playable

pytestmark = pytest.mark.timeout(600)
DB = "/var/lib/memwatch/memwatch.db"
NO_CAPABILITY = "0000000000000000"


def _play(docs: list[dict], name: str) -> Iterator[Played]:
    made: Setup | str = setup()
    if isinstance(made, str):
        pytest.skip(made)
    for doc in docs:
        if doc.get("kind") == "Deployment":
            set_env(engine_spec(doc), STANDIN_STEPS="1000000", STANDIN_PAUSE="0.005", STANDIN_WAIT="1")
    with tempfile.TemporaryDirectory(prefix=f"memwatch-{name}-") as root:
        playable_docs, _ = playable(docs, made.by_role, Path(root))
        up = Played(made.podman, playable_docs, Path(root), name)
        try:
            yield up
        finally:
            up.down()
            write_timings()


@pytest.fixture(scope="module")
def played() -> Iterator[Played]:
    yield from _play(manifest("sidecar", "vllm-with-memwatch.yaml"), "restricted")


@pytest.fixture
def played_as_root() -> Iterator[Played]:
    """The chart rendered with its defaults: vLLM as its image's user (the stand-in's: root)."""
    yield from _play([d for d in yaml.safe_load_all(template("vllm-root", [])) if d], "as-root")


def _status(played: Played, container: str) -> dict[str, str]:
    """The container's main process as the kernel reports it (/proc/1/status: its own pid namespace)."""
    text = played.exec(container, "cat", "/proc/1/status")
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def _assert_restricted(status: dict[str, str], uid: int) -> None:
    assert status["Uid"].split() == [str(uid)] * 4, status["Uid"]  # real, effective, saved, filesystem
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[capabilities] == NO_CAPABILITY, (capabilities, status[capabilities])
    assert status["NoNewPrivs"] == "1"  # allowPrivilegeEscalation: false
    assert status["Seccomp"] == "2"  # a filter: the runtime's default profile, not unconfined (0)


def test_memwatch_runs_non_root_with_nothing_and_a_read_only_root(played: Played) -> None:
    memwatch = played.one("memwatch")
    wait_for(lambda: played.podman.run("exec", memwatch, "test", "-e", DB, check=False).returncode == 0, 60,
             "memwatch's database")
    _assert_restricted(_status(played, memwatch), 10001)
    root = played.podman.run("exec", memwatch, "touch", "/probe", check=False)
    assert root.returncode != 0 and "Read-only file system" in root.stderr, root
    assert played.podman.run("exec", memwatch, "touch", "/tmp/probe", check=False).returncode == 0
    mounts = played.exec(memwatch, "cat", "/proc/self/mountinfo")
    assert any(line.split()[4] == "/tmp" for line in mounts.splitlines()), "/tmp is not a volume of its own"


def test_the_engine_runs_restricted_and_is_stored_through_the_pods_group(played: Played) -> None:
    engine, memwatch = played.one("engine"), played.one("memwatch")
    wait_for(lambda: "serving" in played.logs(engine) or played.state(engine)[0] != "running", 60, "the engine")
    assert played.state(engine)[:2] == ("running", 0), played.logs(engine)
    status = _status(played, engine)
    _assert_restricted(status, 1000)
    assert "10001" in status["Groups"].split()  # fsGroup: the group of the rings directory, its only way in
    count = ("import sqlite3, sys; "
             "print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM samples').fetchone()[0])")
    wait_for(lambda: int(played.exec(memwatch, "python3", "-c", count, DB, check=False) or 0) >= 200, 60,
             "200 samples stored", pause=1)


def test_an_engine_left_as_root_has_no_capability_and_still_writes_its_rings(played_as_root: Played) -> None:
    engine, memwatch = played_as_root.one("engine"), played_as_root.one("memwatch")
    wait_for(lambda: "serving" in played_as_root.logs(engine) or played_as_root.state(engine)[0] != "running", 60,
             "the engine")
    assert played_as_root.state(engine)[:2] == ("running", 0), played_as_root.logs(engine)
    status = _status(played_as_root, engine)
    assert status["Uid"].split() == ["0"] * 4
    assert status["CapEff"] == status["CapBnd"] == NO_CAPABILITY and status["NoNewPrivs"] == "1"
    assert "10001" in status["Groups"].split()  # root without DAC_OVERRIDE gets in as a member, as any uid
    count = ("import sqlite3, sys; "
             "print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM samples').fetchone()[0])")
    wait_for(lambda: int(played_as_root.exec(memwatch, "python3", "-c", count, DB, check=False) or 0) >= 200, 60,
             "200 samples stored", pause=1)
