"""``memwatch sim``: run a simulated engine scenario, list the shipped ones, or print the scorecard."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from memwatch_engine.ring import RingFormatError
from memwatch_engine.ring_reader import RingReader
from memwatch_engine.runtime import default_runtime_dir
from memwatch_engine.spawn import IDLE_EXIT_SECONDS, sidecar_pid, sidecar_running

from ..errors import UsageError
from ..sim import Scenario, SimulationResult, run_scenario, shipped_scenarios
from ..sim.scorecard import render_scorecard, run_scorecard
from ..units import format_bytes
from .options import db_given, db_option, finite_float, json_option

STORE_WAIT_SECONDS = 15.0
"""How long ``sim`` waits for a sidecar to store the run it simulated before it says it has not yet."""


@click.command("sim")
@click.option("--scenario", "scenario", metavar="NAME|FILE", help="A shipped scenario's name or a .toml/.json file.")
@click.option("--list", "list_scenarios", is_flag=True, help="List the shipped scenarios with their descriptions.")
@click.option("--scorecard", is_flag=True,
              help="Run every shipped scenario privately, replay it through the detectors, compare with its [expect].")
@click.option("--runtime-dir", type=click.Path(file_okay=False, path_type=Path), envvar="MEMWATCH_RUNTIME_DIR",
              help="Where the rings go, for a sidecar to store (default: $MEMWATCH_RUNTIME_DIR, "
                   "$XDG_RUNTIME_DIR/memwatch).")
@click.option("--speed", type=finite_float(0.0, 1e6, low_open=True), default=None,
              help="Virtual seconds per wall-clock second, to watch a run live (default: as fast as it goes).")
@click.option("--fleet", "fleet", type=click.IntRange(1, 16), default=None, metavar="N",
              help="Run --trace through N simulated engines, each with its own sidecar, behind a router.")
@click.option("--router", "routers", metavar="POLICY", multiple=True,
              help="With --fleet: round-robin, kv-usage, kv-usage-queue or memwatch (repeatable), or all "
                   "(the default): each policy's tokens/s and p99 queue time over the best baseline's.")
@click.option("--trace", metavar="NAME|FILE", default=None,
              help="With --fleet: a fleet trace (fleet_bursty_long_context, fleet_long_prefill), a shipped "
                   "scenario or a scenario file.")
@click.option("--seed", type=click.IntRange(0), default=None,
              help="With --fleet: the seed of the trace's random requests and the router's tie-breaks "
                   "(default: the trace's own).")
@db_option
@json_option
def command(scenario: str | None, list_scenarios: bool, scorecard: bool, runtime_dir: Path | None,
            speed: float | None, fleet: int | None, routers: tuple[str, ...], trace: str | None, seed: int | None,
            db_path: Path | None, as_json: bool) -> None:
    """Simulate an engine on a virtual GPU, with the real Monitor writing real rings.

    \b
    memwatch sim --list
    memwatch sim --scenario non_torch_leak      then: memwatch explain latest
    memwatch sim --scorecard
    memwatch sim --fleet 4 --trace fleet_bursty_long_context

    A scenario's rings go to the runtime directory, where a sidecar stores them (one is started
    unless MEMWATCH_SPAWN=0, into --db); the command waits until the run is stored. A simulated
    out-of-memory is reported, not failed on: exit 0. --scorecard exits 1 when any scenario does not
    raise what it expects.

    With --fleet, each engine's rings go to a private directory its own sidecar drains and serves on
    loopback; the router scrapes those sidecars (docs/fleet.md). Exit 0 whatever the engines died of.
    """
    if fleet is not None or trace is not None or routers or seed is not None:
        if fleet is None or trace is None or scenario is not None or list_scenarios or scorecard or speed is not None:
            raise UsageError("--fleet N and --trace NAME|FILE go together, without --scenario, --list, --scorecard "
                             "or --speed")
        _fleet(fleet, trace, tuple(dict.fromkeys(routers)), seed, as_json)
        return
    if sum((scenario is not None, list_scenarios, scorecard)) != 1:
        raise UsageError("give exactly one of --scenario NAME|FILE, --list and --scorecard "
                         "(or --fleet N --trace NAME|FILE)")
    if list_scenarios:
        _list(as_json)
    elif scorecard:
        rows = run_scorecard()
        click.echo(json.dumps([row.to_dict() for row in rows], indent=2) if as_json else render_scorecard(rows))
        if not all(row.passed for row in rows):
            raise SystemExit(1)
    else:
        assert scenario is not None
        given = db_given(click.get_current_context())
        _simulate(scenario, runtime_dir or default_runtime_dir(), speed, db_path if given else None, as_json)


def _fleet(engines: int, trace: str, routers: tuple[str, ...], seed: int | None, as_json: bool) -> None:
    """Run the trace through the fleet with each policy; print the table or the JSON."""
    from ..sim.fleet import BASELINES, POLICIES, load_trace, render_table, run_fleet, versus_best

    loaded = load_trace(trace)
    chosen = list(POLICIES) if not routers or "all" in routers else list(routers)
    results = run_fleet(loaded, engines, chosen, seed=loaded.scenario.seed if seed is None else seed)
    if as_json:
        ratios = versus_best(results, BASELINES)
        click.echo(json.dumps({"trace": loaded.name, "engines": engines,
                               "policies": {r.policy: {**r.to_dict(), "versus_best_baseline": ratios[r.policy]}
                                            for r in results}}, indent=2))
    else:
        click.echo(render_table(results, BASELINES))


def _simulate(scenario: str, runtime: Path, speed: float | None, db_path: Path | None, as_json: bool) -> None:
    """Run one scenario; ``db_path``: a --db given on the command line, for the sidecar this run starts."""
    spawn = os.environ.get("MEMWATCH_SPAWN", "1") != "0"
    running = _sidecar_running(runtime)
    if db_path is not None:
        if running:
            raise UsageError(f"a sidecar already runs for {runtime} and stores into its own database, so --db "
                             "cannot apply; drop --db or stop that sidecar first")
        os.environ["MEMWATCH_DB"] = str(db_path)  # the sidecar this run starts stores there
    result = run_scenario(scenario, runtime_dir=runtime, spawn_sidecar=spawn, speed=speed)
    if not as_json:
        click.echo(render_result(result))
    stored, note = _stored(result, runtime, started=spawn and not running)
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "stored": stored, "store_note": note}, indent=2))
    else:
        click.echo(note)


def _stored(result: SimulationResult, runtime: Path, started: bool) -> tuple[bool, str]:
    """Wait until a sidecar has stored the run (its rings drained and removed); whether it did, and a note."""
    rings = [Path(rank.ring_path) for rank in result.ranks if rank.ring_path]
    if not _sidecar_running(runtime) and not started:
        return False, (f"not stored: no sidecar runs for {runtime} and MEMWATCH_SPAWN=0 kept one from starting; "
                f"`memwatch serve` stores the rings left there, then: memwatch check {result.run_id}")
    deadline = time.monotonic() + STORE_WAIT_SECONDS
    _release_writer_locks(rings)
    while any(ring.exists() for ring in rings) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(ring.exists() for ring in rings):
        return False, (f"not stored yet: the sidecar has not drained {runtime} within {STORE_WAIT_SECONDS:.0f} s; "
                f"see {runtime / 'sidecar.log'}")
    pid = _sidecar_pid(runtime)
    who = f"the sidecar (pid {pid})" if pid else "the sidecar"
    lines = [f"stored by {who}; next: memwatch check {result.run_id} / memwatch explain {result.run_id}"]
    if started:
        lines.append(f"that sidecar was started for this run and exits after {IDLE_EXIT_SECONDS} s with nothing "
                     f"to store{f' (kill {pid} stops it now)' if pid else ''}")
    return True, "\n".join(lines)


def _release_writer_locks(rings: list[Path]) -> None:
    """Let a simulated crash's rings read as their writer gone, as a dead engine's would.

    This process wrote them: closing a descriptor of a ring here ends this process's record lock on it (POSIX:
    any close of the file does), so the sidecar ends a ring left open ``crashed`` at its next look at the
    writer (a second). The sidecar removes each ring once its rank's end and the run's status have committed,
    so a command run after ``sim`` reads the run as ended."""
    for ring in rings:
        try:
            RingReader(ring).close()
        except (RingFormatError, OSError):
            pass


def _sidecar_running(runtime: Path) -> bool:
    """Whether a sidecar holds the runtime directory's lock, or its presence marker (creates nothing to ask)."""
    return sidecar_running(runtime)


def _sidecar_pid(runtime: Path) -> int | None:
    return sidecar_pid(runtime)


def _list(as_json: bool) -> None:
    scenarios = [Scenario.load(name) for name in shipped_scenarios()]
    if as_json:
        click.echo(json.dumps([{"name": s.name, "description": s.description,
                                "expect": None if s.expect is None else s.expect.to_dict()} for s in scenarios],
                              indent=2))
        return
    width = max(len(s.name) for s in scenarios)
    for s in scenarios:
        click.echo(f"{s.name:<{width}}  {s.description}")


def render_result(result: SimulationResult) -> str:
    """What ``memwatch sim --scenario`` prints: the run id, the outcome, and each rank's KV sizing."""
    outcome = {"ok": "served every request",
               "oom": "ran out of memory (simulated: nothing real failed)",
               "crashed": "crashed outside PyTorch's allocator (simulated: nothing real failed)",
               "error": "stopped with an error (simulated)"}[result.status]
    lines = [f"run {result.run_id}: scenario {result.scenario}, {result.model}: the simulated engine {outcome}",
             f"  {result.finished_requests:,} of {result.requests:,} requests finished in {result.steps:,} steps "
             f"({result.virtual_duration_ns / 1e9:.1f} s simulated), {result.preemptions:,} preemptions"]
    if result.error:
        lines.append(f"  {result.error}")
    for rank in result.ranks:
        blocks = "-" if rank.num_blocks is None else f"{rank.num_blocks:,}"
        lines.append(f"  rank {rank.rank}: {rank.status}, weights {format_bytes(rank.weights_bytes)}, activation "
                     f"reserve {format_bytes(rank.activation_reserve_bytes)}, {blocks} KV blocks "
                     f"({format_bytes(rank.kv_bytes)})")
    return "\n".join(lines)
