"""``memwatch incidents`` in process (click's runner): its table to the character, its JSON lines, its bounds and
its exit status, over a folder of real bundles built from a stored run.

Three bundles of the simulator's ``long_prefill`` run (an out-of-memory), an hour apart: one under its pod, one
under its host, one whose run recorded neither a host nor a model; and an entry named like a bundle that is not
one (a tar.gz whose first member is ``run.db``).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_incident_trigger_rules import _sql, copy_of

from memwatch.cli import main
from memwatch.incident.bundle import build_at
from memwatch.store import open_store
from memwatch_engine.dirfd import open_dir

MOMENT = 1_800_000_000_999_999_999
"""2027-01-15 08:00:00.999999999 UTC: a nanosecond before the next second, which it is not shown as."""
HOUR = 3600 * 10**9
NOT_A_BUNDLE = "memwatch-incident-20270115T110000.000Z-x-y.tar.gz"
WHY = "starts with 'run.db', not manifest.json; not a memwatch bundle"


def _not_a_bundle() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        info = tarfile.TarInfo("run.db")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"SQLi"))
    return out.getvalue()


@pytest.fixture(scope="module")
def folder(long_prefill_stored: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The folder of three bundles and one entry that is not, and the run's id."""
    root = tmp_path_factory.mktemp("incidents")
    run_id = long_prefill_stored[1]
    plain = copy_of(long_prefill_stored[0], root / "plain.db")
    bare = copy_of(long_prefill_stored[0], root / "bare.db")
    _sql(bare, "UPDATE runs SET hostname = NULL, model = NULL")
    out = root / "incidents"
    out.mkdir(mode=0o700)
    fd = open_dir(out)
    try:
        for path, later, identity in ((plain, 0, {"k8s_pod": "pod-a"}), (plain, 1, {"hostname": "node-7"}),
                                      (bare, 2, None)):
            db = open_store(path, readonly=True)
            try:
                build_at(db, run_id, "oom", fd, out, identity=identity, created_ns=MOMENT + later * HOUR)
            finally:
                db.conn.close()
    finally:
        os.close(fd)
    (out / NOT_A_BUNDLE).write_bytes(_not_a_bundle())
    return out, run_id


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["incidents", *args])
    return result.exit_code, result.output


def _names(run_id: str) -> list[str]:
    """The three bundles' names, newest first."""
    return [f"memwatch-incident-20270115T{hour}0000.999Z-{place}-{run_id}.tar.gz"
            for hour, place in (("10", "unknown"), ("09", "node-7"), ("08", "pod-a"))]


def test_the_table_lists_the_newest_first_and_the_refused_last(folder: tuple[Path, str]) -> None:
    out, run_id = folder
    code, text = _cli(str(out))
    assert code == 6
    verdict = len(f"REFUSED: {WHY}")  # the widest cell of its column
    newest, middle, oldest = _names(run_id)

    def row(when: str, pod: str, model: str, said: str, run: str, name: str) -> str:
        return f"{when:19}  {pod:8}  {model:10}  {said:{verdict}}  {run:12}  {name}"

    assert text.splitlines() == [
        row("TIME (UTC)", "POD/HOST", "MODEL", "VERDICT", "RUN", "BUNDLE"),
        row("2027-01-15 10:00:00", "-", "-", "oom", run_id, newest),
        row("2027-01-15 09:00:00", "node-7", "Qwen3-0.6B", "oom", run_id, middle),
        row("2027-01-15 08:00:00", "pod-a", "Qwen3-0.6B", "oom", run_id, oldest),
        row("-", "-", "-", f"REFUSED: {WHY}", "-", NOT_A_BUNDLE),
        f"error: 1 of 4 entries under {out} were refused (not a bundle, or its manifest failed its checks)"]


def test_json_is_one_object_a_line(folder: tuple[Path, str]) -> None:
    out, run_id = folder
    code, text = _cli(str(out), "--json")
    assert code == 6
    lines = text.splitlines()
    assert lines[-1].startswith("error: 1 of 4 entries under ")
    listed = [json.loads(line) for line in lines[:-1]]
    assert listed == [
        *({"uri": f"{out}/{name}", "refused": False, "error": None, "created_ns": MOMENT + later * HOUR,
           "run_id": run_id, "pod": pod, "model": model, "verdict": "oom", "trigger": "oom"}
          for name, later, pod, model in zip(_names(run_id), (2, 1, 0), (None, "node-7", "pod-a"),
                                              (None, "Qwen3-0.6B", "Qwen3-0.6B"), strict=True)),
        {"uri": f"{out}/{NOT_A_BUNDLE}", "refused": True, "error": WHY, "created_ns": None, "run_id": None,
         "pod": None, "model": None, "verdict": None, "trigger": None}]


def test_only_the_newest_by_name_up_to_the_limit(folder: tuple[Path, str]) -> None:
    out, run_id = folder
    code, text = _cli(str(out), "--limit", "2", "--json")
    assert code == 6
    assert [json.loads(line)["uri"] for line in text.splitlines()[:-1]] == [f"{out}/{_names(run_id)[0]}",
                                                                             f"{out}/{NOT_A_BUNDLE}"]
    assert text.splitlines()[-1] == (f"error: 1 of 2 entries under {out} were refused (not a bundle, or its "
                                     "manifest failed its checks)")
    code, text = _cli(str(out), "--limit", "3")
    assert code == 6 and len(text.splitlines()) == 1 + 3 + 1  # the header, three entries, the error
    code, text = _cli(f"file://{out}/", "--limit", "10000", "--json")
    assert code == 6 and len(text.splitlines()) == 4 + 1
    for limit in ("0", "10001"):
        code, text = _cli(str(out), "--limit", limit)
        assert code == 2 and f"{limit} is not in the range 1<=x<=10000" in text


def test_all_good_bundles_exit_0_and_an_empty_folder_says_so(folder: tuple[Path, str], tmp_path: Path) -> None:
    out, run_id = folder
    code, text = _cli(str(out), "--limit", "3", "--json")  # the three newest by name: the one refused among them
    assert code == 6
    good = tmp_path / "good"
    good.mkdir()
    name = _names(run_id)[1]
    (good / name).write_bytes((out / name).read_bytes())
    code, text = _cli(str(good))
    assert code == 0
    assert text.splitlines()[1:] == [f"2027-01-15 09:00:00  node-7    Qwen3-0.6B  oom      {run_id}  {name}"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli(str(empty)) == (0, f"no bundles under {empty}\n")
    assert _cli(str(empty), "--json") == (0, "")


def test_a_hundred_are_listed_by_default(tmp_path: Path) -> None:
    for n in range(101):  # each empty: refused, and cheap to list
        (tmp_path / f"memwatch-incident-{n:03d}.tar.gz").write_bytes(b"")
    code, text = _cli(str(tmp_path), "--json")
    lines = text.splitlines()
    assert code == 6 and len(lines) == 100 + 1
    assert json.loads(lines[0])["uri"] == f"{tmp_path}/memwatch-incident-001.tar.gz"  # the oldest name left out
    assert lines[-1] == (f"error: 100 of 100 entries under {tmp_path} were refused (not a bundle, or its manifest "
                         "failed its checks)")


def _deep(base: Path, length: int) -> str:
    """A path under ``base`` of ``length`` characters, none of its names over 200."""
    path = str(base)
    while len(path) < length:
        path += "/" + "a" * min(200, length - len(path) - 1)
    return path


def test_a_url_is_at_most_4096_characters(tmp_path: Path) -> None:
    url = "file://" + _deep(tmp_path, 4096 - len("file://"))
    assert len(url) == 4096
    code, text = _cli(url)
    assert code == 3 and text.startswith("error: no folder "), text  # read, and found to name nothing
    code, text = _cli(url + "b")
    assert code == 2 and "4,097 characters is too long (at most 4,096)" in text


def test_a_folder_that_cannot_be_listed_is_one_line_of_bad_input(tmp_path: Path) -> None:
    # A name over the system's 255 characters, and a link that leads back to itself: each the user's path to fix,
    # said in one line (exit 2), never an unexpected error to report.
    too_long = tmp_path / ("a" * 256)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for path, why in ((too_long, "File name too long"), (tmp_path / "loop", "Too many levels of symbolic links")):
        assert _cli(str(path)) == (2, f"error: cannot list {path}: {why}; pass the folder bundles are written to\n")
