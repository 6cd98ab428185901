"""``memwatch demo``: the simulated engine on a virtual GPU, through a real sidecar, then a report."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..sim.demo import check_writable, render, run_demo
from ..store import default_db_path
from .options import Text, db_option, json_option


@click.command("demo")
@db_option
@json_option
@click.option("--scenario", type=Text(), default="demo", show_default=True,
              help="A shipped scenario name or a scenario file (see `memwatch sim --list`).")
def command(db_path: Path | None, as_json: bool, scenario: str) -> None:
    """See memwatch work without a GPU: four 32K-token requests on a simulated 24 GiB card.

    Starts `memwatch serve`, runs nano-vllm's startup and scheduler on a virtual GPU through the real
    plugin and ring, stops the sidecar, and reports what the database holds: phases, the KV budget
    and its check, how many requests fit at once, preemptions and flags.
    """
    from ..sim.scenario import Scenario

    Scenario.load(scenario)  # a bad name or file is refused before anything starts
    check_writable(db_path or default_db_path())  # and so is a place the run cannot be stored in
    if not as_json:
        click.echo("Starting the sidecar and the simulated engine...", err=True)
    summary = run_demo(db_path, scenario)
    if as_json:
        s = summary.sizing
        click.echo(json.dumps({
            "run_id": summary.run.run_id, "db_path": str(summary.db_path), "status": summary.run.status,
            "phases": dict(summary.phases), "weights_bytes": summary.weights_bytes, "kv_allocated": s,
            "formula_blocks": summary.formula_blocks,
            "activation_reserve_bytes": summary.activation_reserve if s else None,
            "non_torch_bytes": summary.non_torch if s else None,
            "cache_slack_bytes": summary.cache_slack if s else None,
            "max_resident_requests": summary.max_resident, "preemptions": summary.preemptions,
            "prefill_steps": summary.prefill_steps, "decode_steps": summary.decode_steps,
            "flags": [dict(zip(("kind", "severity", "message"), f, strict=True)) for f in summary.flags],
        }, indent=2))
        return
    click.echo(render(summary))
