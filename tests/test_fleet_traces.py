"""Loading a fleet's trace: a file, a shipped fleet trace or a shipped scenario, the ``[fleet]`` table, and
every refusal with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.sim.fleet.traces import DEFAULT_SHAPES, from_text, load_trace, parse_shape, shipped_traces

BASE = """
name = "base"
model = "Qwen3-0.6B"
seed = 11
[gpu]
total_bytes = 8_589_934_592
[[workload.requests]]
prompt_tokens = 100
output_tokens = 10
count = 2
interval_s = 0.5
"""
FAULT = """
[[faults]]
kind = "other_process"
size_bytes = 1_000
at_step = 4
"""


def usage(match: str):  # type: ignore[no-untyped-def]
    return pytest.raises(UsageError, match=match)


def test_a_trace_from_a_toml_or_json_file_a_shipped_trace_or_a_shipped_scenario(tmp_path: Path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text(BASE + '[fleet]\nadmission_shapes = ["64:8", "128:16"]\n')
    trace = load_trace(str(toml))
    assert (trace.name, trace.shapes, trace.engine_faults) == ("base", ((64, 8), (128, 16)), ())
    data = {"name": "as-json", "model": "Qwen3-0.6B", "gpu": {"total_bytes": 8_589_934_592},
            "workload": {"requests": [{"prompt_tokens": 100, "output_tokens": 10}]},
            "fleet": {"engine_faults": [{"engine": 1, "kind": "other_process", "size_bytes": 1000, "at_step": 2}]}}
    (tmp_path / "mine.json").write_text(json.dumps(data))
    trace = load_trace(str(tmp_path / "mine.json"))
    assert trace.name == "as-json" and trace.shapes == DEFAULT_SHAPES == ((1024, 256), (4096, 1024))
    assert [(index, fault.kind) for index, fault in trace.engine_faults] == [(1, "other_process")]
    # A shipped fleet trace by name, and a shipped scenario (the default shapes, no fault of one engine).
    assert "fleet_long_prefill" in shipped_traces() and shipped_traces() == sorted(shipped_traces())
    assert all(not name.endswith(".toml") for name in shipped_traces())
    assert load_trace("fleet_long_prefill").name == "fleet_long_prefill"
    scenario = load_trace("other_process")
    assert (scenario.name, scenario.shapes, scenario.engine_faults) == ("other_process", DEFAULT_SHAPES, ())


def test_an_unknown_trace_and_a_name_too_long() -> None:
    listed = ", ".join(shipped_traces())
    with pytest.raises(UsageError) as raised:
        load_trace("no_such_trace")
    assert str(raised.value) == (f"unknown trace 'no_such_trace': not a file, not a fleet trace ({listed}) and not a "
                                 "shipped scenario (memwatch sim --list)")
    # A path that is no file is not looked up as a shipped name; a NUL byte is no file either.
    for ref in ("nowhere/fleet_long_prefill", "nowhere/other_process", "bad\0name"):
        with usage("unknown trace"):
            load_trace(ref)
    with pytest.raises(UsageError) as raised:
        load_trace("x" * 4097)
    assert str(raised.value) == "the trace name or path is 4,097 characters (at most 4,096)"
    with usage("unknown trace 'xxxx"):
        load_trace("x" * 4096)


def test_the_fleet_table_is_checked_key_by_key() -> None:
    with usage(r"^t.toml: not valid TOML: "):
        from_text("name = ", source="t.toml")
    with usage(r"^t.json: not valid JSON: "):
        from_text("{", source="t.json", json_format=True)
    with usage(r"^t.json: a trace must be a table$"):
        from_text("[1, 2]", source="t.json", json_format=True)
    with usage(r"^t.toml: \[fleet\] must be a table$"):
        from_text("fleet = 3\n" + BASE, source="t.toml")
    with usage(r"^t.toml \[fleet\]: unknown key 'engines'; known keys: admission_shapes, engine_faults$"):
        from_text(BASE + "[fleet]\nengines = 2\nzz = 1\n", source="t.toml")
    for key in ("admission_shapes", "engine_faults"):
        with usage(r"^t.toml \[fleet\]: admission_shapes and engine_faults must be lists$"):
            from_text(BASE + f'[fleet]\n{key} = "512:64"\n', source="t.toml")
    with usage(r"^t.toml \[fleet\] admission_shapes: a shape is PROMPT:OUTPUT"):
        from_text(BASE + '[fleet]\nadmission_shapes = ["512"]\n', source="t.toml")
    # A sidecar takes shapes of up to 2^24 tokens each: a longer one is refused with the trace, not by the
    # sidecars the fleet starts with it (whose log went with their temporary directory).
    for shape in ("16777217:1", "1:16777217"):
        with usage(rf"^t.toml \[fleet\] admission_shapes: a shape is PROMPT:OUTPUT in tokens \(1 to 16,777,216 "
                   rf"each\), e.g. 2048:512; got '{shape}'$"):
            from_text(BASE + f'[fleet]\nadmission_shapes = ["{shape}"]\n', source="t.toml")
    # An empty list of shapes keeps the default ones.
    assert from_text(BASE + "[fleet]\nadmission_shapes = []\n", source="t.toml").shapes == DEFAULT_SHAPES
    for fault in ('"other_process"', '{kind = "other_process"}', '{engine = "1", kind = "other_process"}',
                  '{engine = true, kind = "other_process"}'):
        with usage(r"^t.toml \[\[fleet.engine_faults\]\] #2: needs engine = <index> beside the fault's kind"):
            from_text(BASE + "[fleet]\nengine_faults = [{engine = 0, kind = \"other_process\", size_bytes = 1, "
                      f"at_step = 1}}, {fault}]\n", source="t.toml")


def test_each_engine_runs_the_scenario_faults_and_its_own() -> None:
    text = (BASE + FAULT + "[fleet]\n[[fleet.engine_faults]]\nengine = 1\nkind = \"other_process\"\n"
            "size_bytes = 2_000\nat_step = 9\n")
    trace = from_text(text, source="t.toml")
    assert [f.to_dict()["size_bytes"] for f in trace.faults_of(0)] == [1000]
    assert [f.to_dict()["size_bytes"] for f in trace.faults_of(1)] == [1000, 2000]
    trace.check(2)
    with pytest.raises(UsageError) as raised:
        trace.check(1)
    assert str(raised.value) == ("trace base: a fault of engine 1, but the fleet has 1 engines (0 to 0); give "
                                 "--fleet 2 or more")
    negative = from_text(text.replace("engine = 1", "engine = -1"), source="t.toml")
    with usage("a fault of engine -1, but the fleet has 4 engines"):
        negative.check(4)


def test_a_fault_that_adds_requests_has_no_place_in_a_fleet() -> None:
    for where in ("scenario", "engine"):
        fault = '\nkind = "long_prefill"\nprompt_tokens = 1000\noutput_tokens = 16\nat_step = 20\n'
        text = BASE + ("[[faults]]" + fault if where == "scenario" else "[fleet]\n[[fleet.engine_faults]]\nengine = 0"
                                                                        + fault)
        with pytest.raises(UsageError) as raised:
            from_text(text, source="t.toml").check(1)
        assert str(raised.value) == ("trace base: fault long_prefill adds requests at an engine's step; in a fleet "
                                     "every request comes through the router: give it in [workload] instead")


def test_the_routed_stream_is_the_workload_drawn_with_the_seed() -> None:
    text = BASE.replace("[[workload.requests]]", "[workload.random]\ncount = 5\nprompt_tokens_min = 10\n"
                        "prompt_tokens_max = 900\noutput_tokens_min = 5\noutput_tokens_max = 90\n"
                        "stop_fraction_min = 0.5\nrate_per_s = 2.0\n[[workload.requests]]")
    trace = from_text(text, source="t.toml")
    drawn = trace.scenario.workload.generate(11)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens, r.arrival_ns, r.stop_tokens)
            for r in trace.requests()] == [(r.request_id, r.prompt_tokens, r.output_tokens, r.arrival_ns,
                                            r.stop_tokens) for r in drawn]
    assert trace.requests() == trace.requests(11) != trace.requests(12)
    assert any(r.stop_tokens is not None for r in trace.requests())


def test_shapes_at_their_bounds() -> None:
    assert parse_shape("1:1", "here") == (1, 1)
    assert parse_shape("16777216:16777216", "here") == (16_777_216, 16_777_216)
    for bad in ("1:0", "0:1", "1-1", ":1", "1:", "16777217:1", "1:16777217"):
        with usage(r"^here: a shape is PROMPT:OUTPUT in tokens \(1 to 16,777,216 each\), e.g. 2048:512; got "):
            parse_shape(bad, "here")
    with pytest.raises(UsageError) as raised:
        parse_shape("9" * 80, "here")
    assert str(raised.value).endswith(f"got '{'9' * 50}'")


def test_each_refusal_names_where_it_was_found(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = ")
    with usage(f"^{bad}: not valid TOML"):
        load_trace(str(bad))
    with usage(r"^t.toml: .*bogus"):
        from_text("bogus = 1\n" + BASE, source="t.toml")
    with usage(r"^t.toml \[\[fleet.engine_faults\]\] #1"):
        from_text(BASE + '[fleet]\nengine_faults = [{engine = 0, kind = "no_such_kind"}]\n', source="t.toml")
    # A name is looked up among the shipped ones only without a "/": "../long_prefill" would reach the
    # scenarios beside the fleet traces.
    with usage("unknown trace '../long_prefill'"):
        load_trace("../long_prefill")
    with pytest.raises(UsageError) as raised:
        load_trace("y" * 300)
    assert str(raised.value).startswith(f"unknown trace '{'y' * 200}': not a file")
