"""A fleet of simulated engines behind a router that scrapes each one's sidecar: routing policies compared.

``run_fleet(load_trace("fleet_bursty_long_context"), 4)`` runs every policy on a trace and returns one
:class:`PolicyResult` each; ``memwatch sim --fleet N --router POLICY --trace NAME`` is the command.
"""

from memwatch.sim.fleet.fleet import run_fleet
from memwatch.sim.fleet.policies import BASELINES, POLICIES
from memwatch.sim.fleet.results import PolicyResult, render_table, versus_best
from memwatch.sim.fleet.traces import FleetTrace, load_trace, shipped_traces

__all__ = ["BASELINES", "POLICIES", "FleetTrace", "PolicyResult", "load_trace", "render_table", "run_fleet",
           "shipped_traces", "versus_best"]
