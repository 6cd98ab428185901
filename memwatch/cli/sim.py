"""``memwatch sim``: run a simulated engine scenario, list the shipped ones, or print the scorecard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..errors import UsageError
from ..sim import Scenario, SimulationResult, run_scenario, shipped_scenarios
from ..sim.scorecard import render_scorecard, run_scorecard
from ..units import format_bytes
from .options import finite_float, json_option


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
@json_option
def command(scenario: str | None, list_scenarios: bool, scorecard: bool, runtime_dir: Path | None,
            speed: float | None, as_json: bool) -> None:
    """Simulate an engine on a virtual GPU, with the real Monitor writing real rings.

    \b
    memwatch sim --list
    memwatch sim --scenario non_torch_leak      then: memwatch explain latest
    memwatch sim --scorecard

    A scenario's rings go to the runtime directory, where a sidecar stores them (one is started
    unless MEMWATCH_SPAWN=0). A simulated out-of-memory is reported, not failed on: exit 0.
    --scorecard exits 1 when any scenario does not raise what it expects.
    """
    if sum((scenario is not None, list_scenarios, scorecard)) != 1:
        raise UsageError("give exactly one of --scenario NAME|FILE, --list and --scorecard")
    if list_scenarios:
        _list(as_json)
    elif scorecard:
        rows = run_scorecard()
        click.echo(json.dumps([row.to_dict() for row in rows], indent=2) if as_json else render_scorecard(rows))
        if not all(row.passed for row in rows):
            raise SystemExit(1)
    else:
        assert scenario is not None
        spawn = os.environ.get("MEMWATCH_SPAWN", "1") != "0"
        result = run_scenario(scenario, runtime_dir=runtime_dir, spawn_sidecar=spawn, speed=speed)
        click.echo(json.dumps(result.to_dict(), indent=2) if as_json else render_result(result))


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
    lines.append(f"next: memwatch check {result.run_id} / memwatch explain {result.run_id}")
    return "\n".join(lines)
