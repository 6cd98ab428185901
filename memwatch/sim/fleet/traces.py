"""A fleet's trace: one scenario every engine runs (model, GPU, engine, costs, workload), plus what is fleet-wide.

``--trace`` takes what ``sim --scenario`` takes (a shipped scenario's name or a ``.toml``/``.json`` file) and
the shipped fleet traces in ``memwatch/sim/scenarios/fleet/``. The workload is the request stream the router
sees; the scenario's faults apply to every engine. A fleet trace file may add a ``[fleet]`` table:

* ``admission_shapes``: the ``P:O`` shapes each sidecar exports ``memwatch_admissible_requests`` for;
* ``[[fleet.engine_faults]]``: faults of one engine only (``engine = 3`` plus the fault's kind and fields,
  as in ``[[faults]]``), e.g. another process sharing one pod's GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from memwatch.errors import UsageError
from memwatch.export.headroom import MAX_SHAPE_TOKENS
from memwatch.sim.faults import Fault
from memwatch.sim.fleet.engine import FleetRequest
from memwatch.sim.scenario import MAX_SCENARIO_REF, Scenario, _parse_toml, parse_fault, shipped_scenarios

DEFAULT_SHAPES = ((1024, 256), (4096, 1024))
"""The shapes the sidecars of a trace without ``admission_shapes`` export ``memwatch_admissible_requests`` for."""


@dataclass(frozen=True)
class FleetTrace:
    scenario: Scenario
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    engine_faults: tuple[tuple[int, Fault], ...] = ()

    @property
    def name(self) -> str:
        return self.scenario.name

    def faults_of(self, engine: int) -> tuple[Fault, ...]:
        """The scenario's faults plus those of this engine alone."""
        return self.scenario.faults + tuple(fault for index, fault in self.engine_faults if index == engine)

    def requests(self, seed: int | None = None) -> list[FleetRequest]:
        """The routed stream: the workload drawn with ``seed`` (default: the scenario's own)."""
        drawn = self.scenario.workload.generate(self.scenario.seed if seed is None else seed)
        return [FleetRequest(r.request_id, r.prompt_tokens, r.output_tokens, r.arrival_ns, r.stop_tokens)
                for r in drawn]

    def check(self, engines: int) -> None:
        for index, _fault in self.engine_faults:
            if not 0 <= index < engines:
                raise UsageError(f"trace {self.name}: a fault of engine {index}, but the fleet has {engines} engines "
                                 f"(0 to {engines - 1}); give --fleet {index + 1} or more")
        for fault in self.scenario.faults + tuple(fault for _, fault in self.engine_faults):
            if fault.extra_requests():
                raise UsageError(f"trace {self.name}: fault {fault.kind} adds requests at an engine's step; in a "
                                 "fleet every request comes through the router: give it in [workload] instead")


def shipped_traces() -> list[str]:
    """Names of the fleet traces that ship with memwatch."""
    return sorted(entry.name[: -len(".toml")] for entry in _traces_dir().iterdir() if entry.name.endswith(".toml"))


def load_trace(name_or_path: str) -> FleetTrace:
    """A shipped fleet trace, a shipped scenario, or a scenario file with an optional ``[fleet]`` table."""
    if len(name_or_path) > MAX_SCENARIO_REF:
        raise UsageError(f"the trace name or path is {len(name_or_path):,} characters (at most {MAX_SCENARIO_REF:,})")
    path = Path(name_or_path)
    if _is_file(path):
        return from_text(path.read_text(encoding="utf-8"), source=str(path), json_format=path.suffix == ".json")
    shipped = _traces_dir().joinpath(f"{name_or_path}.toml")
    if "/" not in name_or_path and _is_file(shipped):
        return from_text(shipped.read_text(encoding="utf-8"), source=f"fleet/{name_or_path}.toml")
    if "/" not in name_or_path and name_or_path in shipped_scenarios():
        return FleetTrace(Scenario.load(name_or_path))
    raise UsageError(f"unknown trace {name_or_path[:200]!r}: not a file, not a fleet trace "
                     f"({', '.join(shipped_traces())}) and not a shipped scenario (memwatch sim --list)")


def from_text(text: str, *, source: str, json_format: bool = False) -> FleetTrace:
    try:
        data = json.loads(text) if json_format else _parse_toml(text)
    except ValueError as exc:
        raise UsageError(f"{source}: not valid {'JSON' if json_format else 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a trace must be a table")
    data = dict(data)
    fleet = data.pop("fleet", {})
    scenario = Scenario.from_dict(data, source=source)
    if not isinstance(fleet, dict):
        raise UsageError(f"{source}: [fleet] must be a table")
    unknown = sorted(set(fleet) - {"admission_shapes", "engine_faults"})
    if unknown:
        raise UsageError(f"{source} [fleet]: unknown key {unknown[0]!r}; known keys: admission_shapes, engine_faults")
    shapes = tuple(parse_shape(shape, f"{source} [fleet] admission_shapes")
                   for shape in _list(fleet.get("admission_shapes", []), source)) or DEFAULT_SHAPES
    engine_faults = []
    for i, raw in enumerate(_list(fleet.get("engine_faults", []), source)):
        where = f"{source} [[fleet.engine_faults]] #{i + 1}"
        if not isinstance(raw, dict) or not isinstance(raw.get("engine"), int) or isinstance(raw.get("engine"), bool):
            raise UsageError(f"{where}: needs engine = <index> beside the fault's kind and fields")
        fields = {key: value for key, value in raw.items() if key != "engine"}
        engine_faults.append((raw["engine"], parse_fault(fields, where)))
    return FleetTrace(scenario, shapes, tuple(engine_faults))


def parse_shape(value: Any, where: str) -> tuple[int, int]:
    """``"2048:512"`` -> ``(2048, 512)``: prompt and output tokens, both at least 1 and at most what a sidecar's
    ``--admission-shape`` takes (a longer one would stop the fleet's sidecars from starting)."""
    prompt, sep, output = str(value).partition(":")
    if sep and prompt.isdigit() and output.isdigit() and 1 <= int(prompt) <= MAX_SHAPE_TOKENS \
            and 1 <= int(output) <= MAX_SHAPE_TOKENS:
        return int(prompt), int(output)
    raise UsageError(f"{where}: a shape is PROMPT:OUTPUT in tokens (1 to {MAX_SHAPE_TOKENS:,} each), e.g. 2048:512; "
                     f"got {str(value)[:50]!r}")


def _list(value: Any, source: str) -> list[Any]:
    if not isinstance(value, list):
        raise UsageError(f"{source} [fleet]: admission_shapes and engine_faults must be lists")
    return value


def _traces_dir() -> Any:
    return resources.files("memwatch.sim").joinpath("scenarios", "fleet")


def _is_file(path: Any) -> bool:
    try:
        return bool(path.is_file())
    except (OSError, ValueError):
        return False
