"""Run a trace through a fleet of simulated engines behind a router, in lock-step on the simulator's clock.

Every engine has its own virtual GPU, Monitor and ring, and its own sidecar process serving ``/metrics`` on
loopback. Time moves in ticks of :data:`SCRAPE_INTERVAL_NS` (50 ms, the llm-d router's scrape period). At
each tick every engine has run the steps that began before it; when requests reach the router in the tick
(or some wait there), the router first waits (bounded) until each sidecar has drained its engine's rings,
scrapes every engine's ``/metrics``, parses it with the Prometheus client's parser and routes the tick's
requests in arrival order with one policy; a request no engine can admit now waits at the router and is
offered again every :data:`RETRY_TICKS` ticks. A tick with nothing to route needs no scrape: the router's view
is read only when it routes, so skipping those scrapes changes no decision. Then every engine runs on to the
next tick. Nothing depends on how fast this machine is, so the same trace and seed give the same table.

The sidecars are shared by the policies of one call: each policy's engines are new runs with run ids of
their own, and the router reads only its own runs' series.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import deque
from pathlib import Path

from memwatch.errors import UsageError
from memwatch.sim.clock import NS_PER_S
from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.policies import POLICIES, READ, EngineView, Policy, make_policy
from memwatch.sim.fleet.results import PolicyResult, summarize
from memwatch.sim.fleet.scrape import scrape
from memwatch.sim.fleet.sidecar import START_TIMEOUT_S, FleetSidecar
from memwatch.sim.fleet.traces import FleetTrace
from memwatch_engine.monitor import new_run_id

SCRAPE_INTERVAL_NS = 50_000_000
"""The router scrapes every engine every 50 ms of the simulator's clock."""
RETRY_TICKS = 5
"""Requests the router holds are offered to the policy again every 5 ticks (250 ms), with that tick's scrape."""
CATCH_UP_TICKS = 200
"""However long nothing is routed, the fleet waits for its sidecars every 200 ticks (10 s simulated), so a
sidecar never falls a ring's length behind and loses records (which would change what it exports)."""
MAX_ENGINES = 16
DRAIN_AFTER_S = 3600.0
"""The longest the fleet runs on after the trace's last arrival before it stops (a bound, not a target)."""


def run_fleet(trace: FleetTrace, engines: int, policies: list[str] | tuple[str, ...] = POLICIES, seed: int = 0,
              workdir: Path | None = None) -> list[PolicyResult]:
    """Each policy's result on ``trace`` with ``engines`` engines; sidecars and rings live under ``workdir``
    (default: a temporary directory, removed afterwards)."""
    if not 1 <= engines <= MAX_ENGINES:
        raise UsageError(f"--fleet takes 1 to {MAX_ENGINES} engines, got {engines}")
    for name in policies:
        # An unknown name fails before anything starts (this policy is dropped: its generator matters not).
        make_policy(name, random.Random(0))  # pragma: no mutate
    trace.check(engines)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="memwatch-fleet-") as home:
            return _run(trace, engines, list(policies), seed, Path(home))
    return _run(trace, engines, list(policies), seed, workdir)


def _run(trace: FleetTrace, engines: int, policies: list[str], seed: int, home: Path) -> list[PolicyResult]:
    # The sidecars run with a deployment's settings: the default staleness, on the wall clock the engines'
    # records are stamped with (:mod:`.engine`).
    args = tuple(arg for prompt, output in trace.shapes for arg in ("--admission-shape", f"{prompt}:{output}"))
    sidecars = [FleetSidecar(home / f"engine{i}", args) for i in range(engines)]
    try:
        for sidecar in sidecars:
            sidecar.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for sidecar in sidecars:
            sidecar.wait_listening(deadline)
        return [_run_policy(trace, sidecars, name, seed) for name in policies]
    finally:
        for sidecar in sidecars:
            sidecar.close()


def _run_policy(trace: FleetTrace, sidecars: list[FleetSidecar], name: str, seed: int) -> PolicyResult:
    rng = random.Random(seed)
    policy = make_policy(name, rng)
    start_ns = time.time_ns()
    fleet = [FleetEngine(i, trace.scenario, trace.faults_of(i), sidecar.runtime_dir, start_ns, new_run_id())
             for i, sidecar in enumerate(sidecars)]
    try:
        for engine, sidecar in zip(fleet, sidecars, strict=True):  # pragma: no mutate (built one for one)
            engine.start()
            if engine.alive:  # one that died starting has closed its rings, which its sidecar may have removed
                sidecar.watch(engine.ring_paths)
        serving_ns = max(engine.clock.now_ns() for engine in fleet)  # every engine serves from the same instant
        for engine in fleet:
            engine.clock.advance_to(serving_ns)
        requests = trace.requests(seed)
        arrivals = deque(requests)
        held: deque[FleetRequest] = deque()
        views = {engine.index: EngineView(engine.index, engine.runners[0].monitor.run_id) for engine in fleet}
        last_arrival = requests[-1].arrival_ns  # a workload has at least one request
        rejected, tick = 0, 0
        while True:
            now = tick * SCRAPE_INTERVAL_NS
            arrived = []
            while arrivals and arrivals[0].arrival_ns < now + SCRAPE_INTERVAL_NS:
                arrived.append(arrivals.popleft())
            due, held = offered(held, arrived, tick)
            alive = [engine for engine in fleet if engine.alive]
            if due and not alive:
                rejected += len(due)  # no engine is up
            elif due:
                idle = not arrivals and not any(engine.busy for engine in alive)
                rejected += _route(policy, due, held, alive, sidecars, views, serving_ns, idle)
            if not arrivals and not held and not any(engine.busy for engine in fleet):
                break
            if now > last_arrival + DRAIN_AFTER_S * NS_PER_S:
                rejected += len(held)
                break
            tick += 1
            for engine in alive:
                engine.advance_to(serving_ns + tick * SCRAPE_INTERVAL_NS)
                if tick % CATCH_UP_TICKS == 0:
                    sidecars[engine.index].wait_drained()
        return _result(trace, fleet, name, seed, requests, rejected, serving_ns)
    finally:
        for engine in fleet:
            engine.close()


def offered(held: deque[FleetRequest], arrived: list[FleetRequest],
            tick: int) -> tuple[list[FleetRequest], deque[FleetRequest]]:
    """The requests the router offers the engines at ``tick``, and those it goes on holding: first come, first
    served, so newcomers queue behind held ones, which are offered again every :data:`RETRY_TICKS` ticks."""
    if held and tick % RETRY_TICKS:
        held.extend(arrived)
        return [], held
    return [*held, *arrived], deque()


def _route(policy: Policy, due: list[FleetRequest], held: deque[FleetRequest], alive: list[FleetEngine],
           sidecars: list[FleetSidecar], views: dict[int, EngineView], serving_ns: int, idle: bool) -> int:
    """Scrape every engine that is up (once each has drained its rings), then route ``due`` in order; what the
    policy keeps goes to ``held``. Returns the requests rejected: those held while the fleet was idle, with
    nothing arriving, which no later scrape can admit. (So nothing is routed after such a rejection, and
    nothing was rejected before a call, which finds an engine up: adding what it returns is assigning it.)"""
    for engine in alive:
        sidecar = sidecars[engine.index]
        sidecar.wait_drained()
        view = views[engine.index]
        view.rescraped(scrape(sidecar.url, READ))  # pragma: no mutate (READ only spares parsing the rest)
    routed = 0
    for request in due:
        choice = policy.choose(request, [views[engine.index] for engine in alive])
        if choice is None:
            held.append(request)
            continue
        alive[[engine.index for engine in alive].index(choice)].submit(request, serving_ns)
        views[choice].send(request)
        routed += 1  # pragma: no mutate (only whether any was routed is read)
    if idle and held and not routed:
        rejected = len(held)
        held.clear()
        return rejected
    return 0


def _result(trace: FleetTrace, fleet: list[FleetEngine], name: str, seed: int, requests: list[FleetRequest],
            rejected: int, serving_ns: int) -> PolicyResult:
    # A completion ends a step, which takes time: the last one is past 0, and 0 only stands for none.
    queue_ns, output_tokens, last_finish, lost = [], 0, 0, 0
    for engine in fleet:
        finished = engine.finished_ns
        for request_id, request in engine.requests.items():
            if request_id in finished:
                queue_ns.append(engine.started_ns[request_id] - serving_ns - request.arrival_ns)
                output_tokens += request.generated_tokens
                last_finish = max(last_finish, finished[request_id] - serving_ns)
            else:
                lost += 1
    return summarize(name, trace.name, len(fleet), seed, len(requests), queue_ns, output_tokens, last_finish,
                     ooms=sum(engine.status == "oom" for engine in fleet),
                     preemptions=sum(engine.preemptions for engine in fleet), lost=lost, rejected=rejected,
                     simulated_ns=max(engine.clock.now_ns() for engine in fleet) - serving_ns)

