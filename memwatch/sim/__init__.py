"""The simulator: a virtual GPU and a simulated nano-vllm engine driving the real Monitor and ring.

``run_scenario("demo")`` runs a shipped scenario; :class:`Scenario` loads one from TOML or JSON.
"""

from memwatch.sim.gpu import SimulatedOutOfMemory, VirtualGPU
from memwatch.sim.result import RankSummary, SimulationResult
from memwatch.sim.run import run_scenario
from memwatch.sim.scenario import Scenario, shipped_scenarios

__all__ = [
    "RankSummary",
    "Scenario",
    "SimulatedOutOfMemory",
    "SimulationResult",
    "VirtualGPU",
    "run_scenario",
    "shipped_scenarios",
]
