"""Property-based fuzzing: hostile bytes and values give one clean refusal, never a traceback or a hang."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

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
        except RingFormatError:
            return
        try:
            for start in (0, cursor):
                drained = reader.drain(start, 16)
                assert drained.next_cursor >= start
                for _seq, _ts, why, raw in drained.bad:
                    assert isinstance(why, str) and isinstance(raw, bytes)
        except RingFormatError:
            pass
        finally:
            reader.close()


@FAST
@given(settings_map=st.dictionaries(st.sampled_from([f.name for f in DetectorConfig.__dataclass_fields__.values()])
                                    | st.text(max_size=12), json_values, max_size=5))
def test_thresholds_refuse_cleanly(settings_map: dict[str, object]) -> None:
    try:
        DetectorConfig.from_mapping(settings_map)
    except MemwatchError:
        pass


@FAST
@given(config=st.dictionaries(st.sampled_from(["model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "vocab_size", "torch_dtype",
                                               "intermediate_size", "text_config", "quantization_config",
                                               "max_position_embeddings", "tie_word_embeddings"]) | st.text(max_size=8),
                              json_values, max_size=8))
def test_model_configs_refuse_cleanly(config: dict[str, object]) -> None:
    try:
        ModelSpec.from_config(config, "fuzz")
    except MemwatchError:
        pass


@FAST
@given(data=st.dictionaries(st.sampled_from(["name", "model", "gpu", "workload", "engine", "cost", "faults", "seed"])
                            | st.text(max_size=8), json_values, max_size=6))
def test_scenarios_refuse_cleanly(data: dict[str, object]) -> None:
    try:
        Scenario.from_dict(data)
    except MemwatchError:
        pass


@FAST
@given(text=st.text(max_size=200))
def test_scenario_text_refuses_cleanly(text: str) -> None:
    for json_format in (False, True):
        try:
            Scenario.from_text(text, json_format=json_format)
        except MemwatchError:
            pass


ARGUMENTS = st.one_of(
    st.text(max_size=30), st.integers().map(str), st.floats().map(str), st.sampled_from(["", "-", "--", "%", "_"]),
    st.just("9" * 400), st.just("[" * 3000),
)
COMMANDS = [
    ["runs", "-n"], ["timeline", "latest", "--rank"], ["timeline", "latest", "--last"], ["timeline"], ["check"],
    ["explain"], ["plan", "--gpu-memory"], ["plan", "--gpu-memory", "80GB", "--tp"],
    ["plan", "--gpu-memory", "80GB", "--pp"], ["plan", "--gpu-memory", "80GB", "--utilization"],
    ["plan", "--gpu-memory", "80GB", "--seqs"], ["plan", "--gpu-memory", "80GB", "--block-size"],
["sim", "--scenario", "demo", "--speed"],
    ["serve", "--poll-interval"], ["serve", "--exit-when-idle", "0", "--give-up-after"], ["attach", "--interval"],
    ["events"], ["flags"],
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(COMMANDS), value=ARGUMENTS)
def test_every_cli_argument_gets_one_line_never_a_traceback(command: list[str], value: str) -> None:
    if command[0] in {"serve", "sim", "attach"}:
        command = [*command, value, "--definitely-not-an-option"]  # parse the value, then stop at a usage error
    else:
        command = [*command, value]
    with tempfile.TemporaryDirectory() as tmp:
        result = CliRunner().invoke(main, [*command, *(["--db", str(Path(tmp) / "none.db")]
                                                       if command[0] in {"runs", "timeline", "check", "explain",
                                                                         "events", "flags"} else [])])
    assert result.exception is None or isinstance(result.exception, SystemExit), (command, result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1, 2, 3, 4, 5, 6)
    if result.exit_code >= 2:
        assert [line for line in result.output.splitlines() if line.startswith("error: ")], result.output
