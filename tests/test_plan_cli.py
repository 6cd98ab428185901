"""``memwatch plan`` end to end through click: the ledger text, the JSON keys, one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.cli.plan import plan
from memwatch.models import ModelSpec, forward_activation_bytes
from memwatch.store import open_store
from memwatch.store.run_figures import RANK_KEYS

GIB, MIB = 2**30, 2**20
SEED = ["--gpu-memory", "24GiB", "--weights-bytes", "15GiB", "--activation-reserve-bytes", "2GiB",
        "--non-torch-bytes", "0", "--seqs", "4", "--seq-len", "32768"]


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No test reaches the Hub: an empty cache of its own, and downloads forbidden."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_seed_ledger_as_text() -> None:
    code, out, err = invoke(*SEED)
    assert (code, err) == (1, "")                                     # does not fit: exit 1
    assert "57,344 B    56.00 KiB" in out
    assert "25,769,803,776 B    24.00 GiB  = 25.77 GB" in out           # both unit systems, unambiguous
    assert "4,939,212,390 B     4.60 GiB" in out
    rows = [line.split() for line in out.splitlines() if line.endswith(("  yes", "  no"))]
    assert [(row[0], row[1], row[-1]) for row in rows] == [
        ("1", "1.75", "yes"), ("2", "3.50", "yes"), ("3", "5.25", "no"), ("4", "7.00", "no")]
    assert "max concurrency: 2 sequences (2 ideal)" in out
    assert "verdict: does not fit, short by 2.40 GiB (2,576,980,378 B)" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_seed_ledger_as_json() -> None:
    code, out, _ = invoke(*SEED, "--json")
    data = json.loads(out)
    assert code == 1
    assert {key: data[key] for key in ("kv_bytes_per_token", "block_bytes", "kv_budget_bytes", "kv_blocks",
                                       "max_resident_tokens", "max_concurrent_seqs", "required_kv_bytes",
                                       "fits", "shortfall_bytes")} == {
        "kv_bytes_per_token": 57_344, "block_bytes": 14_680_064, "kv_budget_bytes": 4_939_212_390,
        "kv_blocks": 336, "max_resident_tokens": 336 * 256, "max_concurrent_seqs": 2,
        "required_kv_bytes": 7 * GIB, "fits": False, "shortfall_bytes": 2_576_980_378}


@pytest.mark.parametrize(("tp", "per_rank"), [("2", 3.5 * GIB), ("4", 1.75 * GIB)])
def test_per_rank_kv_under_tp(tp: str, per_rank: float) -> None:
    code, out, _ = invoke(*SEED, "--tp", tp, "--json")
    assert code == 0 and json.loads(out)["required_kv_bytes"] == per_rank


def test_model_from_a_config_directory_and_gb_units(tmp_path: Path) -> None:
    shipped = Path(__file__).parents[1] / "memwatch/models/configs/Llama-2-7b-hf.json"
    (tmp_path / "config.json").write_text(shipped.read_text())
    code, out, _ = invoke("--model", str(tmp_path), "--gpu-memory", "40GB", "--utilization", "0.5",
                          "--weights-bytes", "13000000000", "--activation-reserve-bytes", "1GB",
                          "--non-torch-bytes", "0", "--tokens", "4096", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["kv_budget_bytes"] == 20 * 10**9 - 14 * 10**9
    assert data["kv_blocks"] == 6 * 10**9 // (256 * 524_288) == 44
    assert data["required_kv_bytes"] == 16 * 256 * 524_288 and data["fits"] is True


def test_explicit_kv_size_and_estimated_non_kv() -> None:
    code, out, _ = invoke("--kv-cache-memory-bytes", "4GiB", "--seq-len", "4096")
    qwen = ModelSpec.load("Qwen2.5-7B-Instruct")
    estimate = forward_activation_bytes(qwen, 16_384, 4, prefill=True)
    assert code == 0
    assert f"{estimate:,} B" in out and "estimate (warmup)" in out
    assert "not deducted" in out
    assert "max concurrency: 18 sequences" in out                    # 4 GiB / 224 MiB per 4,096 tokens


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-memory", "lots"], "error: invalid size 'lots'"),
    (["--gpu-memory", "24GiB", "--utilization", "0.8", "--kv-cache-memory-bytes", "4GiB"],
     "error: --utilization and --kv-cache-memory-bytes are mutually exclusive"),
    (["--gpu-memory", "24GiB", "--tp", "8"], "error: tensor parallel size 8 does not divide the 28 query heads"),
    (["--gpu-memory", "24"], "error: --gpu-memory 24 is 24 bytes, less than any GPU; give a unit, "
                             "e.g. --gpu-memory 24GiB"),
    (["--gpu-memory", "80", "--seqs", "1", "--seq-len", "10"], "error: --gpu-memory 80 is 80 bytes"),
    ([], "error: the plan needs --gpu-memory"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    code, out, err = invoke(*args)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_unknown_model_is_not_found_and_says_where_it_looked(offline_hub: Path) -> None:
    code, out, err = invoke("--model", "no-such-org/no-such-model", "--gpu-memory", "24GiB")
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith("error: unknown model 'no-such-org/no-such-model'")
    assert f"not in the Hugging Face cache {offline_hub}" in err and "HF_HUB_OFFLINE" in err


def test_a_bare_byte_count_of_a_real_gpu_is_still_accepted() -> None:
    code, out, _ = invoke("--gpu-memory", "25769803776", "--non-torch-bytes", "0", "--json")
    assert code == 0 and json.loads(out)["gpu_memory_bytes"] == 24 * GIB


def test_verdicts_and_exit_codes() -> None:
    fits = ["--gpu-memory", "80GiB", "--seqs", "1", "--seq-len", "4096"]
    assert invoke(*fits)[0] == 0
    code, out, _ = invoke("--gpu-memory", "24GiB", "--seqs", "8", "--seq-len", "32768")
    assert code == 1 and "verdict: does not fit" in out
    assert invoke("--gpu-memory", "24GiB")[0] == 0                   # no target, no verdict


def test_the_readme_question_counts_the_memory_outside_pytorch() -> None:
    """The measured demo run on a 24 GiB device held 347 blocks and two 32K requests at once; a plan
    without memory outside PyTorch promised 391 blocks and three."""
    code, out, _ = invoke("--gpu-memory", "24GiB", "--seqs", "4", "--seq-len", "32768", "--json")
    data = json.loads(out)
    assert code == 1                                                  # four do not fit
    qwen = ModelSpec.load("Qwen2.5-7B-Instruct")
    activation = forward_activation_bytes(qwen, 16_384, 1, prefill=True)    # warmup: one 16,384-token prefill
    kv_budget = int(24 * GIB * 0.9) - 512 * MIB - 15_231_233_024 - activation
    assert (data["non_torch_bytes"], data["non_torch_estimated"]) == (512 * MIB, True)
    assert data["non_torch_terms"] == {"cuda_context": 512 * MIB, "nccl": 0}
    assert data["kv_budget_bytes"] == kv_budget
    assert data["kv_blocks"] == kv_budget // 14_680_064 < 391
    assert 347 <= data["kv_blocks"] <= 347 + 10                      # within 10 blocks of the measured run
    assert data["max_concurrent_seqs"] == 2 == 347 // 128              # 128 blocks per 32K request
    _, text, _ = invoke("--gpu-memory", "24GiB", "--seqs", "4", "--seq-len", "32768")
    assert "− non-PyTorch" in text and "estimate: CUDA context 512 MiB" in text
    # the option replaces the estimate, and its own line says so
    _, out, _ = invoke("--gpu-memory", "24GiB", "--seq-len", "32768", "--non-torch-bytes", "611MiB", "--json")
    data = json.loads(out)
    assert (data["non_torch_bytes"], data["non_torch_estimated"]) == (611 * MIB, False)
    assert data["kv_budget_bytes"] == int(24 * GIB * 0.9) - 611 * MIB - 15_231_233_024 - activation


def test_non_torch_estimate_grows_with_tensor_parallel() -> None:
    _, out, _ = invoke("--gpu-memory", "24GiB", "--tp", "2", "--json")
    assert json.loads(out)["non_torch_terms"] == {"cuda_context": 512 * MIB, "nccl": 256 * MIB}
    _, out, _ = invoke("--gpu-memory", "80GiB", "--tp", "4", "--pp", "4", "--json")
    assert json.loads(out)["non_torch_terms"]["nccl"] == 16 * GIB // 8      # tp × pp / 8 GiB


def test_non_torch_estimate_depends_on_the_engine() -> None:
    """vLLM 0.33.0's custom all-reduce cudaMallocs, per rank at TP 2, 4, 6, 8 or 16: an 8 MiB temporary buffer
    beside its signals, and an input buffer of max(8, 2, 16) MiB; nano-vllm reduces through NCCL alone."""
    _, out, _ = invoke("--engine", "vllm", "--gpu-memory", "80GiB", "--tp", "2", "--json")
    data = json.loads(out)
    assert data["non_torch_terms"] == {"cuda_context": 512 * MIB, "nccl": 256 * MIB, "custom_all_reduce": 24 * MIB}
    assert data["non_torch_bytes"] == 792 * MIB
    _, out, _ = invoke("--engine", "vllm", "--gpu-memory", "80GiB", "--json")
    assert json.loads(out)["non_torch_terms"] == {"cuda_context": 512 * MIB, "nccl": 0, "custom_all_reduce": 0}
    _, out, _ = invoke("--engine", "nano-vllm", "--gpu-memory", "80GiB", "--tp", "2", "--json")
    assert json.loads(out)["non_torch_bytes"] == 768 * MIB                 # context and NCCL alone
    _, text, _ = invoke("--engine", "vllm", "--gpu-memory", "80GiB", "--tp", "4")
    assert "estimate: CUDA context 512 MiB + NCCL 512 MiB + vLLM custom all-reduce 24 MiB" in " ".join(text.split())


@pytest.mark.parametrize("option", [["--gpu-memory", "24GiB"], ["--seqs", "4"], ["--model", "Llama-2-7b-hf"],
                                    ["--engine", "vllm"], ["--non-torch-bytes", "1GiB"], ["--tp", "1"]])
def test_run_refuses_planning_options_it_cannot_apply(option: list[str], tmp_path: Path) -> None:
    code, out, err = invoke("--run", "latest", "--db", str(tmp_path / "none.db"), *option)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --run compares a recorded run with the plan for the config it recorded; "
                          f"{option[0]} cannot apply to it")


def test_config_missing_a_field_is_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}))
    code, _, err = invoke("--model", str(path), "--gpu-memory", "1GiB")
    assert code == 2 and "lacks 'intermediate_size'" in err


@pytest.mark.parametrize(("value", "bytes_"), [("1073741823", "1,073,741,823"), (" 24 ", "24")])
def test_a_bare_number_under_a_gibibyte_is_taken_for_a_unit_left_out(value: str, bytes_: str) -> None:
    code, out, err = invoke("--gpu-memory", value, "--non-torch-bytes", "0")
    assert (code, out) == (2, "")
    assert err == (f"error: --gpu-memory {value} is {bytes_} bytes, less than any GPU; give a unit, e.g. "
                   f"--gpu-memory {value.strip()}GiB\n")


@pytest.mark.parametrize(("value", "size"), [("1073741824", GIB), ("512MiB", 512 * MIB), ("2147483648", 2 * GIB)])
def test_a_gibibyte_or_a_size_with_its_unit_is_planned(value: str, size: int) -> None:
    code, out, _ = invoke("--gpu-memory", value, "--non-torch-bytes", "0", "--json")
    assert code in (0, 1) and json.loads(out)["gpu_memory_bytes"] == size  # 7B weights: too big, yet planned


def test_run_names_every_planning_option_it_refuses(tmp_path: Path) -> None:
    code, out, err = invoke("--run", "latest", "--db", str(tmp_path / "none.db"), "--max-num-seqs", "4",
                            "--kv-cache-memory-bytes", "1GiB", "--block-size", "16")
    assert (code, out) == (2, "")
    assert "; --kv-cache-memory-bytes, --block-size, --max-num-seqs cannot apply to it. Drop them" in err


def test_plan_against_a_recorded_run(tmp_path: Path) -> None:
    qwen = ModelSpec.load("Qwen2.5-7B-Instruct")
    weights, reserve, total = qwen.weight_bytes(), forward_activation_bytes(qwen, 16_384, 1, prefill=True), 80 * GIB
    current, peak, used = weights, weights + reserve + GIB, weights + 600 * MIB
    config = {"model_config": "Qwen2.5-7B-Instruct", "gpu_memory_utilization": 0.9, "block_size": 256,
              "max_num_batched_tokens": 16_384, "max_model_len": 32_768, "max_num_seqs": 512}
    sizing = {"total_bytes": total, "gpu_memory_utilization": 0.9, "used_bytes": used, "peak_bytes": peak,
              "current_bytes": current, "reserved_bytes": current, "block_bytes": 14_680_064,
              "num_blocks": int(total * 0.9 - used - peak + current) // 14_680_064}
    db = tmp_path / "memwatch.db"
    connection = open_store(db).conn  # the real schema, as the sidecar creates it
    connection.execute("INSERT INTO runs (run_id, pid, hostname, engine, model, rank_count, started_ns, ended_ns,"
                       " status, gpu_name, gpu_total_bytes, config) VALUES ('demo1', 1, 'h', 'sim',"
                       " 'Qwen2.5-7B-Instruct', 1, 5, 9, 'ok', 'Simulated', ?, ?)", (total, json.dumps(config)))
    connection.execute("INSERT INTO events VALUES ('demo1', 0, 0, 7, 'kv_allocated', ?)", (json.dumps(sizing),))
    connection.commit()
    connection.close()

    code, out, _ = invoke("--run", "latest", "--db", str(db))
    assert code == 0
    assert "run demo1 rank 0: Qwen2.5-7B-Instruct, 80.00 GiB × 0.9; warmup 1 × 16,384 tokens" in out
    assert "activation reserve" in out and "1.00 GiB" in out and "peak was not reset" in " ".join(out.split())
    assert "non-PyTorch" in out and "600.00 MiB" in out
    assert all(len(line) <= 80 for line in out.splitlines())

    db.chmod(0o664)  # the group may write it: plan --run only reads, so it still answers
    code, out, _ = invoke("--run", "demo1", "--db", str(db), "--json")
    [data] = json.loads(out)
    assert code == 0 and out.splitlines()[:2] == ["[", "  {"] and out.splitlines()[2].startswith('    "')
    assert [term["term"] for term in data["terms"]] == ["weights", "activation reserve", "non-PyTorch", "cache slack",
                                                     "KV blocks"]
    assert data["terms"][1]["diff_bytes"] == GIB
    # the rank's shared quantities, as every command names them: no samples, so no margin
    assert {key: data[key] for key in ("oom_step", "non_torch_at_sizing_bytes", "oom_margin_bytes",
                                       "weights_bytes", "kv_cache_bytes")} == {
        "oom_step": None, "non_torch_at_sizing_bytes": 600 * MIB, "oom_margin_bytes": None,
        "weights_bytes": weights, "kv_cache_bytes": sizing["num_blocks"] * 14_680_064}

    code, _, err = invoke("--run", "nope", "--db", str(db))
    assert code == 3 and err.startswith("error: no run 'nope'")


def test_plan_against_a_stored_demo_run(tmp_path: Path) -> None:
    from stored_runs import store_scenario

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "demo.db"
    run_id = store_scenario("demo", runtime, db)
    code, out, _ = invoke("--run", run_id, "--db", str(db), "--json")
    assert code == 0
    [rank] = json.loads(out)
    terms = {term["term"]: term for term in rank["terms"]}
    # The simulator uses the planner's own parameter count and activation model: both terms match,
    # and the CUDA context the plan leaves out (non-PyTorch) is what costs the KV blocks.
    assert abs(terms["weights"]["diff_bytes"]) < 2 * MIB          # allocator rounding of the weights
    assert terms["activation reserve"]["diff_bytes"] == 0
    assert terms["non-PyTorch"]["predicted_bytes"] == 512 * MIB   # the estimate: one CUDA context
    assert terms["non-PyTorch"]["measured_bytes"] == 512 * MIB    # the simulated CUDA context (used − reserved)
    assert terms["non-PyTorch"]["cause"] == "as planned"
    assert 0 < terms["cache slack"]["measured_bytes"] < 87 * 2 * MIB  # segment rounding of the weights' tensors
    assert terms["KV blocks"]["measured_bytes"] == 347 * 14_680_064
    assert 347 <= terms["KV blocks"]["predicted_blocks"] <= 347 + 10
    # one value per quantity: the rank's shared figures are check's, and the KV is the blocks it measured
    checked = CliRunner().invoke(main, ["--db", str(db), "check", run_id, "--json"])
    [shared] = json.loads(checked.stdout)["ranks"]
    assert {key: rank[key] for key in RANK_KEYS} == {key: shared[key] for key in RANK_KEYS}
    assert rank["kv_cache_bytes"] == 347 * 14_680_064 and rank["oom_margin_bytes"] > 0
