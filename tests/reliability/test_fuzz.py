"""Property-based fuzzing: hostile bytes and values give one clean refusal, never a traceback or a hang, and a
value that is certainly bad is refused (the exit code and the words of the refusal), never silently taken."""

from __future__ import annotations

import math
import struct
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memwatch.cli import main
from memwatch.detectors import DetectorConfig
from memwatch.errors import MemwatchError
from memwatch.models.spec import ModelSpec
from memwatch.sim.scenario import Scenario
from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingFormatError, RingWriter
from memwatch_engine.ring_reader import RingReader

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(slots=st.binary(min_size=RECORD_SIZE * 8, max_size=RECORD_SIZE * 8), published=st.integers(0, 2**64 - 1),
       header_junk=st.binary(max_size=64), cursor=st.integers(0, 2**40))
def test_ring_reader_takes_any_slot_bytes(slots: bytes, published: int, header_junk: bytes, cursor: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.ring"
        RingWriter(path, run_id="fz", capacity=8).close()
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE)
            f.write(slots)
            f.seek(56)
            f.write(struct.pack("<Q", published))
            f.seek(112)
            f.write(header_junk)
        try:
            reader = RingReader(path)
        except RingFormatError as exc:
            assert "metadata" in str(exc), exc  # the slots and the count are read later: only metadata is refused
            return
        try:
            for start in (0, cursor):
                drained = reader.drain(start, 16)
                assert drained.next_cursor >= start
                # Whatever is taken is whole: each sample holds the sequence number of its place, in order,
                # within what was published, and the cursor moves past exactly what was read or lost.
                seqs = [sample[0] for sample in drained.samples]
                assert seqs == sorted(seqs) and all(start <= seq < published for seq in seqs), seqs
                assert drained.next_cursor <= max(start, published)
                for _seq, _ts, why, raw in drained.bad:
                    assert isinstance(why, str) and why and isinstance(raw, bytes)
        except RingFormatError as exc:
            assert any(words in str(exc) for words in ("published count went back", "do not hold the sequence numbers",
                                                       "truncated")), exc
        finally:
            reader.close()


@FAST
@given(settings_map=st.dictionaries(st.sampled_from([f.name for f in DetectorConfig.__dataclass_fields__.values()])
                                    | st.text(max_size=12), json_values, max_size=5))
def test_thresholds_refuse_cleanly(settings_map: dict[str, object]) -> None:
    fields = {f.name for f in DetectorConfig.__dataclass_fields__.values()}
    fractions = {"reserve_overstated_ratio", "kv_pressure_usage", "fragmentation_budget_fraction",
                 "fragmentation_reserve_ratio"}

    def bad(key: str, value: object) -> bool:
        if key not in fields:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        return not 0 < value <= 1 if key in fractions else not (isinstance(value, int) and value >= 1)

    wrong = [key for key, value in settings_map.items() if bad(key, value)]
    try:
        config = DetectorConfig.from_mapping(settings_map)
    except MemwatchError as exc:
        assert exc.exit_code == 2 and wrong, (settings_map, exc)
        assert any(repr(key) in str(exc) or f"setting {key} " in str(exc) for key in wrong), exc
        return
    assert not wrong, f"accepted {wrong} of {settings_map}"
    assert all(getattr(config, key) == value for key, value in settings_map.items())


@FAST
@given(config=st.dictionaries(st.sampled_from(["model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "vocab_size", "torch_dtype",
                                               "intermediate_size", "text_config", "quantization_config",
                                               "max_position_embeddings", "tie_word_embeddings"]) | st.text(max_size=8),
                              json_values, max_size=8))
def test_model_configs_refuse_cleanly(config: dict[str, object]) -> None:
    from memwatch.models.bounds import FIELD_BOUNDS

    def out_of_range(key: str) -> bool:
        value, (low, high) = config[key], FIELD_BOUNDS[key]
        if value is None:
            return False
        return isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high

    # A field that is not a number in its range, anywhere at the top level, must be refused by name.
    wrong = [key for key in config if key in FIELD_BOUNDS and out_of_range(key)]
    try:
        spec = ModelSpec.from_config(config, "fuzz")
    except MemwatchError as exc:
        assert exc.exit_code == 2 and "\n" not in str(exc), exc
        assert "'fuzz'" in str(exc) or "dtype" in str(exc), exc
        if wrong:  # it names that field, or one nested deeper that is wrong too
            assert any(f"{key} is " in str(exc) for key in FIELD_BOUNDS), (wrong, exc)
        return
    assert not wrong, f"accepted {wrong} of {config}"
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        low, high = FIELD_BOUNDS[name]
        assert isinstance(getattr(spec, name), int) and low <= getattr(spec, name) <= high, (name, spec)


@FAST
@given(data=st.dictionaries(st.sampled_from(["name", "model", "gpu", "workload", "engine", "cost", "faults", "seed"])
                            | st.text(max_size=8), json_values, max_size=6))
def test_scenarios_refuse_cleanly(data: dict[str, object]) -> None:
    try:
        scenario = Scenario.from_dict(data)
    except MemwatchError as exc:
        assert exc.exit_code == 2 and str(exc) and "\n" not in str(exc), exc
        return
    assert isinstance(scenario.name, str) and scenario.gpu.total_bytes > 0


@FAST
@given(text=st.text(max_size=200))
def test_scenario_text_refuses_cleanly(text: str) -> None:
    for json_format in (False, True):
        try:
            scenario = Scenario.from_text(text, json_format=json_format)
        except MemwatchError as exc:
            assert exc.exit_code == 2 and str(exc) and "\n" not in str(exc), exc
            continue
        assert isinstance(scenario.name, str) and scenario.gpu.total_bytes > 0


ARGUMENTS = st.one_of(
    st.text(max_size=30), st.integers().map(str), st.floats().map(str), st.sampled_from(["", "-", "--", "%", "_"]),
    st.just("9" * 400), st.just("[" * 3000), st.integers(-3, 40).map(str),
)


def _int(value: str) -> int | None:
    try:
        return int(value)
    except ValueError:
        return None


def _float(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def _int_option(name: str, low: int, high: int, good: set[int] | None = None, words: tuple[str, ...] = ()):
    """Refused (2, naming the option) unless an integer from low to high; accepted for the values in ``good``."""
    def expect(value: str) -> tuple[object, tuple[str, ...]] | None:
        number = _int(value)
        if number is None or not low <= number <= high:
            return 2, (name, *words)
        return ((0, 1), ()) if good is None or number in good else None
    return expect


def _float_option(name: str, low: float, high: float, then: tuple[object, tuple[str, ...]]):
    """Refused (2, naming the option) unless a finite number in (low, high]; else ``then``."""
    def expect(value: str) -> tuple[object, tuple[str, ...]] | None:
        number = _float(value)
        if number is None or not math.isfinite(number) or not low < number <= high:
            return 2, (name,)
        return then
    return expect


def _run_ref(value: str) -> tuple[object, tuple[str, ...]]:
    """The database holds one run, ``fuzzrun``: ``latest`` and its prefixes name it; nothing else does."""
    if value == "--":
        return 2, ("argument",)  # the end of options: --db becomes an extra argument
    if value.startswith("-") and value != "-":
        return 2, ("no such option",)  # an option, not a run: the usage error names it
    if value == "latest" or (value and RUN.startswith(value)):
        return (0, 1), ()
    if not value.strip():
        return 2, ("empty",)
    return 3, ("no run",)


def _duration(value: str) -> tuple[object, tuple[str, ...]] | None:
    if not any(c in "0123456789" for c in value):
        return 2, ("duration",)
    return ((0,), ()) if value.isascii() and value.isdigit() and len(value) < 30 else None


RUN = "fuzzrun"
PLAN = ["plan", "--gpu-memory", "80GB"]
COMMANDS = {
    ("runs", "-n"): _int_option("'-n' / '--limit'", 0, 2**31 - 1, good=None),
    ("timeline", "latest", "--rank"): _int_option("'--rank'", 0, 2**31 - 1, good={0}),
    ("timeline", "latest", "--last"): _duration,
    ("timeline",): _run_ref, ("check",): _run_ref, ("explain",): _run_ref, ("events",): _run_ref,
    ("flags",): _run_ref,
    ("plan", "--gpu-memory"): lambda v: (2, ("size",)) if not any(c.isdigit() for c in v) else None,
    (*PLAN, "--tp"): _int_option("--tp", 1, 2**20, good={1, 2, 4}, words=("tensor parallel",)),
    (*PLAN, "--pp"): _int_option("--pp", 1, 28, good={1, 2}, words=("pipeline parallel",)),
    (*PLAN, "--utilization"): _float_option("utilization", 0, 1, ((0, 1), ())),
    (*PLAN, "--seq-len", "1024", "--seqs"): _int_option("--seqs", 1, 2**40, good={1, 2, 3, 40}),
    (*PLAN, "--block-size"): _int_option("--block-size", 1, 2**20, good={16, 32}, words=("block size",)),
    ("sim", "--scenario", "no-such-scenario", "--speed"): _float_option("--speed", 0, 1e6, (2, ("unknown scenario",))),
    ("events", "latest", "--rank"): _int_option("'--rank'", 0, 2**31 - 1, good={0}),
    ("flags", "latest", "--rank"): _int_option("'--rank'", 0, 2**31 - 1, good={0}),
    ("sql", "SELECT 1", "--timeout"): lambda v: (
        (2, ("--timeout",)) if _float(v) is None or not 0 <= (_float(v) or 0) <= 86400 * 366 else None),
    ("attach", "999999999", "--interval"): lambda v: (
        (2, ("--interval",)) if _float(v) is None or not 0 < (_float(v) or 0) <= 86400
        else (3, ("no process",))),
}
"""Each command line to end with a value, and what the value must give: (exit codes, words of the message),
or None where the value is neither certainly bad nor certainly good (then: one clean line, no traceback)."""


@pytest.fixture(scope="module")
def fuzz_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from memwatch.sidecar.collector import Collector
    from memwatch.store import open_store
    from memwatch.store.writer import StoreWriter

    tmp = tmp_path_factory.mktemp("fuzz")
    ring = RingWriter(tmp / f"{RUN}-r0.ring", run_id=RUN, meta={"engine": "e", "model": "m"}, capacity=64)
    for step in range(5):
        ring.write_sample(step, 10**18 + step * 10**9, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.close()
    writer = StoreWriter(open_store(tmp / "fuzz.db"))
    writer.start()
    collector = Collector(tmp, tmp / "fuzz.db", writer, is_alive=lambda pid, start: False)
    collector.scan()
    while collector.poll():
        pass
    assert writer.flush(timeout=30)
    collector.close()
    writer.close()
    return tmp / "fuzz.db"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(COMMANDS)), value=ARGUMENTS)
def test_every_cli_argument_is_refused_by_name_or_taken(fuzz_db: Path, command: tuple[str, ...], value: str) -> None:
    args = [*command, value]
    if command[0] in {"runs", "timeline", "check", "explain", "events", "flags", "sql"}:
        args += ["--db", str(fuzz_db)]
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert "Traceback" not in result.output and "error: unexpected" not in result.output, (args, result.output[-500:])
    assert result.exit_code in (0, 1, 2, 3, 4, 5, 6)
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    if result.exit_code >= 2:
        assert errors, result.output
    expected = COMMANDS[command](value)
    if expected is None:
        return
    codes, words = expected
    codes = codes if isinstance(codes, tuple) else (codes,)
    assert result.exit_code in codes, (args[:6], value[:40], result.exit_code, result.output[-300:])
    assert all(any(w in line for line in errors) for w in words[:1]) or any(
        w in line for w in words for line in errors), (value[:40], words, errors)


@settings(max_examples=30, deadline=None)
@given(value=ARGUMENTS)
def test_serve_stops_at_a_usage_error_before_it_starts(value: str) -> None:
    result = CliRunner().invoke(main, ["serve", "--poll-interval", value, "--definitely-not-an-option"])
    assert result.exit_code == 2 and result.output.startswith("error: "), result.output
    assert "no such option" in result.output or "--poll-interval" in result.output, result.output
