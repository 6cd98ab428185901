"""The node agent (the DaemonSet's pod) and engine pods on one "node", in real podman containers.

The manifests under deploy/daemonset run with their own users, capabilities, security context, volumes,
env and probes; only what podman lacks is changed (tests/podman/transforms.py). The stand-in engine is
vllm/vllm-openai's ENTRYPOINT with a simulated engine writing rings through the installed plugin.
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from podman.fixtures import Setup, query
from podman.node import Node
from podman.pods import Played, http_get, wait_for
from podman.runtime import timings

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))  # the flood, shared with the benches
from flooded_dir import HealthProbe, flood, refused, toggler
from flooded_dir import stop as stop_process

pytestmark = pytest.mark.timeout(600)
STEPS = 2000
HEALTH, METRICS = 8081, 9400
FLOOD_NAMES = 200_000
NEIGHBOUR = 50001  # a member of the rings directory's group that no --trust-uid names
STORED_WITHIN_S = 3.0


@pytest.fixture
def node(built: Setup) -> Iterator[Node]:
    with tempfile.TemporaryDirectory(prefix="memwatch-node-") as root:
        made = Node(built, Path(root))
        try:
            yield made
        finally:
            made.close()


def runs(db: Path) -> dict[str, tuple[str, int, int]]:
    """run_id -> (run status, decode samples stored, records lost) for every stored run."""
    rows = query(db, "SELECT r.run_id, r.status, (SELECT count(*) FROM samples s WHERE s.run_id = r.run_id AND "
                     "s.step_kind = 'decode'), (SELECT coalesce(sum(k.lost_records), 0) FROM ranks k "
                     "WHERE k.run_id = r.run_id) FROM runs r")
    return {run: (status, samples, lost) for run, status, samples, lost in rows}


def test_the_agent_starts_as_shipped_stays_up_and_makes_its_rings_directory_3770(node: Node) -> None:
    agent = node.agent.one("memwatch")
    wait_for(node.rings.is_dir, 20, "the rings directory")
    time.sleep(5)  # a crash loop shows within seconds: exit 5, then a restart
    status, code, restarts = node.agent.state(agent)
    assert (status, restarts) == ("running", 0), (code, node.agent.logs(agent))
    assert oct(node.rings.stat().st_mode & 0o7777) == oct(0o3770)
    assert http_get(node.ports[HEALTH], "/healthz")[0] == 200
    assert node.agent.healthcheck(agent) == 0  # the manifest's livenessProbe, run by podman with curl


def test_two_engine_pods_of_two_uids_are_stored_whole_and_drained_at_shutdown(node: Node) -> None:
    engines = node.engines({1000: "engine-1000", 65534: "engine-65534"}, STANDIN_STEPS=str(STEPS),
                           STANDIN_WAIT="1")
    ids = engines.container_ids("engine")
    assert len(ids) == 2
    stored = wait_for(lambda: (r := runs(node.db)) and len(r) == 2 and all(s == STEPS for _, s, _ in r.values())
                      and r, 120, f"two runs of {STEPS} decode samples", pause=1)
    assert {status for status, _, _ in stored.values()} == {"running"}
    assert {ring.stat().st_uid for ring in node.rings.glob("*.ring")} == {1000, 65534}
    engines.down()  # SIGTERM: the stand-in exits 0 as vLLM does, without Monitor.close()
    ended = wait_for(lambda: (r := runs(node.db)) and all(s != "running" for s, _, _ in r.values()) and r, 30,
                     "both runs to end")
    assert {status for status, _, _ in ended.values()} == {"ok"}, ended  # a clean exit, by the exit hook
    node.agent.down()
    final = runs(node.db)
    assert [(samples, lost) for _, samples, lost in final.values()] == [(STEPS, 0), (STEPS, 0)], final
    assert not list(node.rings.glob("*.ring"))  # every ring stored and removed


def test_an_engine_pod_killed_ends_crashed_within_the_liveness_interval(node: Node) -> None:
    engines = node.engines({1000: "engine-killed"}, STANDIN_STEPS="200", STANDIN_WAIT="1")
    wait_for(lambda: (r := runs(node.db)) and next(iter(r.values()))[1] == 200, 60, "200 samples stored")
    killed = time.monotonic()
    node.built.podman.run("kill", engines.one("engine"), timeout=30)
    wait_for(lambda: any(s == "crashed" for s, _, _ in runs(node.db).values()), 20, "the run to be crashed")
    seconds = time.monotonic() - killed
    timings["crashed seen after podman kill"] = round(seconds, 2)
    assert seconds < 10  # the liveness probe's period (10 s in the manifest)


def test_an_untrusted_engine_uid_is_refused_where_an_operator_looks(node: Node) -> None:
    node.engines({4242: "engine-untrusted"}, STANDIN_STEPS="50", STANDIN_WAIT="1")
    metric = re.compile(r'^memwatch_rings_refused\{[^}]*reason="[^"]+"[^}]*\} ([0-9.e+]+)$', re.M)

    def refused() -> float:
        found = metric.findall(http_get(node.ports[METRICS], "/metrics")[1])
        return sum(float(v) for v in found)

    wait_for(lambda: refused() >= 1, 30, "memwatch_rings_refused >= 1 on /metrics", pause=1)
    status, body = http_get(node.ports[HEALTH], "/readyz")
    assert "refused" in body, (status, body)
    logs = node.agent.logs(node.agent.one("memwatch"))
    assert len([line for line in logs.splitlines() if "4242" in line]) == 1, logs


def test_the_engine_pod_as_shipped_starts_and_runs_its_steps(node: Node) -> None:
    engines = node.engines({1000: "engine-shipped"}, STANDIN_STEPS="300", STANDIN_WAIT="1")
    engine = engines.one("engine")
    wait_for(lambda: "stepped 300" in engines.logs(engine) or engines.state(engine)[0] != "running", 60,
             "300 steps or an exit")
    assert engines.state(engine) == ("running", 0, 0), engines.logs(engine)  # not `vllm serve vllm serve`: exit 2


def test_an_engine_that_returns_from_main_is_stored_as_a_clean_exit(node: Node) -> None:
    node.engines({1000: "engine-returns"}, STANDIN_STEPS="300")  # main returns, Monitor.close() never called
    first = wait_for(lambda: (r := query(node.db, "SELECT status FROM runs ORDER BY started_ns LIMIT 1"))
                     and r[0][0] != "running" and r[0][0], 30, "the first run to end")
    assert first == "ok"


class Liveness(threading.Thread):
    """The manifest's livenessProbe run by podman every ``every`` seconds (podman's own timers need systemd):
    each run's exit status, 0 for healthy."""

    def __init__(self, played: Played, container: str, every: float = 3.0) -> None:
        super().__init__(name="liveness", daemon=True)
        self.played, self.container, self.every = played, container, every
        self.results: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.results.append(self.played.healthcheck(self.container))

    def stop(self) -> list[int]:
        self.done.set()
        self.join(timeout=90)
        return self.results


def _samples(db: Path, run_id: str) -> int:
    rows = query(db, "SELECT count(*) FROM samples WHERE run_id = ? AND step_kind = 'decode'", (run_id,))
    return int(rows[0][0]) if rows else 0


@pytest.mark.skipif(refused() is not None, reason=str(refused()))
def test_the_agent_under_a_names_flood_stays_live_and_stores_a_trusted_ring_within_seconds(node: Node) -> None:
    """A neighbour in the rings directory's group floods it (from the node, as another pod mounting it would)
    with 200,000 empty ``*.ring`` names while the agent runs, then toggles one more every 0.5 s; two trusted
    engine pods started then, one after the other, have their rings' first samples stored within 3 s of the ring
    appearing, /healthz answers 200 within 1 s every 0.2 s throughout, the liveness probe never fails and the
    agent never restarts."""
    agent = node.agent.one("memwatch")
    wait_for(lambda: http_get(node.ports[HEALTH], "/healthz")[0] == 200, 30, "the agent's /healthz")
    node.root.chmod(0o711)  # the node's own directories are passable by every uid, the rings directory is not
    group = node.rings.stat().st_gid
    probe, liveness = HealthProbe(node.ports[HEALTH]), Liveness(node.agent, agent)
    probe.start()
    liveness.start()
    toggling, stored = None, list[float]()
    try:
        began = time.monotonic()
        flood(node.rings, FLOOD_NAMES, uid=NEIGHBOUR, group=group, timeout=150)
        timings["flood of names made"] = round(time.monotonic() - began, 1)
        toggling = toggler(node.rings, uid=NEIGHBOUR, group=group)
        for uid in (1000, 65534):  # one after another: each arrives at its own point of any listing's pace
            run = f"flooded{uid}"
            ring = node.rings / f"{run}-r0.ring"
            node.engines({uid: f"engine-{run}"}, STANDIN_STEPS="300", STANDIN_WAIT="1", MEMWATCH_RUN_ID=run)
            wait_for(ring.exists, 60, f"the trusted engine's ring {ring.name}", pause=0.02)
            appeared = time.monotonic()
            wait_for(lambda run=run: _samples(node.db, run) > 0, 60, f"{run}'s samples", pause=0.05)
            stored.append(round(time.monotonic() - appeared, 2))
            wait_for(lambda run=run: _samples(node.db, run) == 300, 30, f"all 300 of {run}'s samples", pause=0.2)
        timings["trusted rings stored after they appeared, under the flood"] = max(stored)
        # the agent keeps turning while the toggling goes on, for at least 5 s and 5 liveness checks (each check is a
        # `podman exec`: how many fit in the run's own time depends on the machine's load)
        time.sleep(5)
        wait_for(lambda: len(liveness.results) >= 5, 60, "5 runs of the liveness probe", pause=0.5)
    finally:
        answers, checks = probe.stop(), liveness.stop()
        if toggling is not None:
            stop_process(toggling)
    logs = node.agent.logs(agent)
    status, code, restarts = node.agent.state(agent)
    late = [a for a in answers if a != "200"]
    print(f"{FLOOD_NAMES:,} names + toggling: rings stored {stored} s after they appeared; /healthz not 200 on "
          f"{len(late)} of {len(answers)} ({late[:3]}); liveness {checks}; restarts {restarts}")
    assert (status, restarts) == ("running", 0), (code, logs[-3000:])
    assert stored and max(stored) < STORED_WITHIN_S, (stored, logs[-3000:])
    assert len(answers) >= 50 and not late, late[:5]
    assert len(checks) >= 5 and set(checks) == {0}, checks
    assert len(logs) < 64 * 1024, len(logs)  # 200,000 refused names are not 200,000 log lines
