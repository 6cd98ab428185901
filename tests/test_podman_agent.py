"""The node agent (the DaemonSet's pod) and engine pods on one "node", in real podman containers.

The manifests under deploy/daemonset run with their own users, capabilities, security context, volumes,
env and probes; only what podman lacks is changed (tests/podman/transforms.py). The stand-in engine is
vllm/vllm-openai's ENTRYPOINT with a simulated engine writing rings through the installed plugin.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from podman.fixtures import Setup, query
from podman.node import Node
from podman.pods import http_get, wait_for
from podman.runtime import timings

pytestmark = pytest.mark.timeout(600)
STEPS = 2000
HEALTH, METRICS = 8081, 9400


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
