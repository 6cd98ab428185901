"""A scenario: the device, the model, the engine settings, the cost model, the workload and the faults.

Scenarios are TOML (or JSON) files; the shipped ones live in ``memwatch/sim/scenarios/`` and load by
name (``Scenario.load("demo")``). Byte counts are plain integers (TOML allows ``25_769_803_776``).
Every table is checked against its dataclass: an unknown key or a value of the wrong type is a
one-line :class:`memwatch.errors.UsageError` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from memwatch.errors import UsageError
from memwatch.models import ModelSpec
from memwatch.models.spec import canonical_dtype
from memwatch.sim.config import CostModel, EngineConfig, GPUConfig
from memwatch.sim.expectation import Expectation
from memwatch.sim.fault_kinds import FAULT_KINDS  # importing it registers every shipped kind
from memwatch.sim.faults import Fault
from memwatch.sim.workload import RandomRequests, RequestGroup, Workload


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    gpu: GPUConfig
    workload: Workload
    engine: EngineConfig = field(default_factory=EngineConfig)
    cost: CostModel = field(default_factory=CostModel)
    faults: tuple[Fault, ...] = ()
    description: str = ""
    seed: int = 0
    expect: Expectation | None = None
    """What the detectors should raise on this scenario (the ``[expect]`` table), for the scorecard."""

    def __post_init__(self) -> None:
        longest = self.workload.longest_request
        if longest > self.engine.max_model_len:
            raise UsageError(f"scenario {self.name}: a request can reach {longest} tokens but max_model_len is "
                             f"{self.engine.max_model_len}; raise max_model_len or shorten the requests")
        for fault in self.faults:
            if fault.rank is not None and not 0 <= fault.rank < self.engine.tensor_parallel_size:
                raise UsageError(f"scenario {self.name}: fault {fault.kind} targets rank {fault.rank}, "
                                 f"but there are {self.engine.tensor_parallel_size} ranks")
            fault.check(self.engine, self.name)

    def model_file(self) -> str | None:
        """The model's config file or directory when the scenario names one that exists, as an absolute path."""
        path = Path(self.model).expanduser()
        return str(path.resolve()) if path.exists() else None

    def model_spec(self) -> ModelSpec:
        """The model at the engine's precision, checked to shard over the engine's TP size like nano-vllm."""
        spec = ModelSpec.load(self.model)
        if self.engine.dtype is not None:
            spec = dataclasses.replace(spec, dtype=canonical_dtype(self.engine.dtype))
        tp = self.engine.tensor_parallel_size
        spec.check_tp(tp)
        if spec.num_key_value_heads % tp:
            raise UsageError(f"scenario {self.name}: nano-vllm needs tensor_parallel_size to divide the "
                             f"{spec.num_key_value_heads} KV heads of {spec.name}, got {tp}")
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The scenario in the file format (``Scenario.from_dict`` reads it back), without null values."""
        workload: dict[str, Any] = {"requests": [dataclasses.asdict(group) for group in self.workload.groups]}
        if self.workload.random is not None:
            workload["random"] = _without_none(dataclasses.asdict(self.workload.random))
        return {
            "name": self.name, "description": self.description, "model": self.model, "seed": self.seed,
            "gpu": dataclasses.asdict(self.gpu), "engine": _without_none(dataclasses.asdict(self.engine)),
            "cost": dataclasses.asdict(self.cost), "workload": workload,
            "faults": [_without_none(fault.to_dict()) for fault in self.faults],
            **({} if self.expect is None else {"expect": self.expect.to_dict()}),
        }

    # -- loading -------------------------------------------------------------------------------------

    @classmethod
    def load(cls, name_or_path: str | Path) -> Scenario:
        """A scenario file (``.toml`` or ``.json``) or the name of a shipped scenario."""
        text = str(name_or_path)
        if len(text) > MAX_SCENARIO_REF:
            raise UsageError(f"the scenario name or path is {len(text):,} characters (at most {MAX_SCENARIO_REF:,}); "
                             f"give a shipped scenario ({', '.join(shipped_scenarios())}) or a scenario file")
        path = Path(name_or_path)
        if _is_file(path):
            scenario = cls.from_text(path.read_text(encoding="utf-8"), source=str(path),
                                     json_format=path.suffix == ".json")
            return dataclasses.replace(scenario, model=_beside(path, scenario.model))
        shipped = _scenarios_dir().joinpath(f"{name_or_path}.toml")
        if "/" in text or not _is_file(shipped):
            raise UsageError(f"unknown scenario {text[:200]!r}: not a file and not a shipped scenario "
                             f"({', '.join(shipped_scenarios())})")
        return cls.from_text(shipped.read_text(encoding="utf-8"), source=f"{name_or_path}.toml")

    @classmethod
    def from_text(cls, text: str, *, source: str = "scenario", json_format: bool = False) -> Scenario:
        try:
            data = json.loads(text) if json_format else _parse_toml(text)
        except ValueError as exc:
            raise UsageError(f"{source}: not valid {'JSON' if json_format else 'TOML'}: {exc}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "scenario") -> Scenario:
        data = _table(data, source)
        known = {"name", "model", "gpu", "workload", "engine", "cost", "faults", "description", "seed", "expect"}
        _reject_unknown(data, known, source)
        for key in ("model", "gpu", "workload"):
            if key not in data:
                raise UsageError(f"{source}: missing {key!r}; a scenario needs model, [gpu] and [workload]")
        workload = _table(data["workload"], f"{source} [workload]")
        _reject_unknown(workload, {"requests", "random"}, f"{source} [workload]")
        groups = workload.get("requests", [])
        if not isinstance(groups, list):
            raise UsageError(f"{source}: workload.requests must be a list of tables ([[workload.requests]])")
        faults = data.get("faults", [])
        if not isinstance(faults, list):
            raise UsageError(f"{source}: faults must be a list of tables ([[faults]])")
        scalars = {key: data[key] for key in ("name", "model", "description", "seed") if key in data}
        _check_fields(Scenario, scalars, source)
        return cls(
            name=scalars.get("name", Path(source).stem),
            model=scalars["model"],
            gpu=build(GPUConfig, data["gpu"], f"{source} [gpu]"),
            engine=build(EngineConfig, data.get("engine", {}), f"{source} [engine]"),
            cost=build(CostModel, data.get("cost", {}), f"{source} [cost]"),
            workload=Workload(
                groups=tuple(build(RequestGroup, group, f"{source} [[workload.requests]] #{i + 1}")
                             for i, group in enumerate(groups)),
                random=(build(RandomRequests, workload["random"], f"{source} [workload.random]")
                        if "random" in workload else None),
            ),
            faults=tuple(parse_fault(raw, f"{source} [[faults]] #{i + 1}") for i, raw in enumerate(faults)),
            description=scalars.get("description", ""),
            seed=scalars.get("seed", 0),
            expect=build(Expectation, data["expect"], f"{source} [expect]") if "expect" in data else None,
        )


def _beside(scenario_file: Path, model: str) -> str:
    """A scenario file's relative model path, read from the file's folder rather than the current directory.

    ``models/tiny`` next to the file is that folder's, wherever memwatch runs from; a name that is no path there
    (a shipped model, a Hugging Face id) is left as it is, and so is an absolute path."""
    path = Path(model)
    if path.is_absolute() or model.startswith("~"):
        return model
    beside = scenario_file.parent / path
    explicit = model.startswith(("./", "../")) or path.suffix == ".json"
    return str(beside.resolve()) if explicit or beside.exists() else model


def shipped_scenarios() -> list[str]:
    """Names of the scenarios that ship with memwatch."""
    return sorted(entry.name[: -len(".toml")] for entry in _scenarios_dir().iterdir()
                  if entry.name.endswith(".toml"))


def parse_fault(raw: Any, where: str) -> Fault:
    """Build a fault from a scenario table: ``kind`` plus that kind's fields."""
    raw = _table(raw, where)
    kind = raw.get("kind")
    cls = FAULT_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise UsageError(f"{where}: unknown fault kind {kind!r}; known kinds: {', '.join(sorted(FAULT_KINDS))}")
    return build(cls, {key: value for key, value in raw.items() if key != "kind"}, f"{where} ({kind})")


T = typing.TypeVar("T")


def build(cls: type[T], table: Any, where: str) -> T:
    """Construct dataclass ``cls`` from a scenario table, checking keys and value types first."""
    table = _table(table, where)
    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    _reject_unknown(table, names, where)
    _check_fields(cls, table, where)
    try:
        return cls(**table)
    except TypeError:
        missing = sorted(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                         if f.init and f.name not in table and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        raise UsageError(f"{where}: missing {', '.join(repr(name) for name in missing)}") from None


def _check_fields(cls: type, table: Mapping[str, Any], where: str) -> None:
    hints = typing.get_type_hints(cls)
    for key, value in table.items():
        allowed = _allowed_types(hints[key])
        ok = any(isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
                 for kind in allowed)
        if not ok:
            names = " or ".join("none" if kind is type(None) else kind.__name__ for kind in allowed)
            raise UsageError(f"{where}: {key} must be {names}, got {value!r}")


def _allowed_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(kind for arg in typing.get_args(hint) for kind in _allowed_types(arg))
    if hint is float:
        return (float, int)
    return (typing.get_origin(hint) or hint,)


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in table.items() if value is not None}


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise UsageError(f"{where} must be a table, got {type(value).__name__}")
    return value


def _reject_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")


def _parse_toml(text: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise UsageError("reading TOML scenarios needs Python 3.11 or the tomli package; "
                             "install tomli or write the scenario as JSON") from None
    return tomllib.loads(text)


def _scenarios_dir() -> Any:
    return resources.files("memwatch.sim").joinpath("scenarios")


MAX_SCENARIO_REF = 4096
"""The longest scenario name or path taken (a path longer than the system's limit is no file)."""


def _is_file(path: Any) -> bool:
    """Whether ``path`` is a file; a name the system refuses (too long, a NUL) is not one."""
    try:
        return bool(path.is_file())
    except (OSError, ValueError):
        return False
