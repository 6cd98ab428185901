"""``memwatch plan``: how much KV cache a rank holds and whether a target load fits; or, with
``--run``, a recorded run's plan against what its engine measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import MemwatchError, UsageError
from ..models.quantization import METHODS as QUANTIZATION_METHODS
from ..models.spec import ModelSpec
from ..plan.capacity import MAX_BLOCK_TOKENS, MAX_TARGET, PlanInputs, plan_capacity
from ..plan.engines import ENGINES, VLLM_VERSIONS
from ..plan.observed import compare_run
from ..plan.report import render_observed, render_plan
from ..plan.runs import shaped
from ..store import open_store
from ..store.run_model import load_run as load_stored
from ..units import GIB, parse_bytes
from .options import RUN_REF, ModelRef, Text, db_option, finite_float, int_range, json_option

KV_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
DOES_NOT_FIT = 1
"""Exit code of a plan whose verdict is "does not fit" (or that the engine would refuse to start)."""
MIN_BARE_GPU_MEMORY = GIB
"""A bare ``--gpu-memory`` number below this is taken for a unit left out (``24`` meant ``24GiB``)."""
_PLANNING_OPTIONS = ("model", "gpu_memory", "utilization", "kv_cache_memory_bytes", "weights_bytes",
                     "activation_reserve_bytes", "non_torch_bytes", "cudagraph_bytes", "dtype", "kv_dtype",
                     "quantization", "engine", "engine_version", "extensible_kv_cache", "tp", "pp", "block_size",
                     "seqs", "seq_len", "tokens", "max_num_batched_tokens", "max_num_seqs")


def _size(value: str | None) -> int | None:
    return None if value is None else parse_bytes(value)


def _gpu_memory(value: str | None) -> int | None:
    size = _size(value)
    if value is not None and size is not None and value.strip().isdigit() and size < MIN_BARE_GPU_MEMORY:
        raise UsageError(f"--gpu-memory {value} is {size:,} bytes, less than any GPU; "
                         f"give a unit, e.g. --gpu-memory {value.strip()}GiB")
    return size


def _refuse_planning_options(ctx: click.Context) -> None:
    """``--run`` plans from the run's recorded config, so options that describe another plan are refused."""
    given = [name for name in _PLANNING_OPTIONS
             if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"--run compares a recorded run with the plan for the config it recorded; {flags} "
                         "cannot apply to it. Drop them, or plan without --run")


def _plan_run(db_path: Path | None, run: str, as_json: bool) -> None:
    db = open_store(db_path, readonly=True)
    model = load_stored(db, run)
    record, events = shaped(model)
    comparisons = compare_run(record, events)
    if as_json:
        from ..store.run_figures import RANK_KEYS

        truth = model.figures
        rows = []
        for comparison in comparisons:  # each rank's shared quantities, as every command names them
            row, shared = comparison.to_dict(), truth.rank(comparison.rank)
            rows.append({**row, **({} if shared is None else {k: getattr(shared, k) for k in RANK_KEYS})})
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(render_observed(comparisons))


@click.command("plan")
@click.option("--model", "model", type=ModelRef(), default="Qwen2.5-7B-Instruct", show_default=True,
              help="config.json, a directory holding one, a Hugging Face repo id (org/name[@revision]) "
                   "or a shipped model name.")
@click.option("--engine", type=click.Choice(ENGINES), default="nano-vllm", show_default=True,
              help="Whose budget rule and defaults to plan with.")
@click.option("--engine-version", type=Text(32),
              help=f"vLLM's release, e.g. 0.34 or 0.34.0: its defaults and KV sizing [default: "
                   f"{VLLM_VERSIONS[-1]}; known: {', '.join(VLLM_VERSIONS)}].")
@click.option("--extensible-kv-cache/--no-extensible-kv-cache", default=None,
              help="vLLM 0.34's extensible KV cache, sized on the memory free after warmup [default: on for 0.34 "
                   "unless --kv-cache-memory-bytes].")
@click.option("--gpu-memory", type=Text(), help="Device bytes per rank: 25769803776, 24GiB (2^30) or 24GB (10^9).")
@click.option("--utilization", type=finite_float(0, 1, low_open=True),
              help="Share of the device the engine may use (SGLang: mem_fraction_static) "
                   "[default: the engine's].")
@click.option("--kv-cache-memory-bytes", type=Text(), help="Explicit KV bytes per rank; replaces --utilization.")
@click.option("--weights-bytes", type=Text(), help="Weight bytes per rank [default: counted from the config].")
@click.option("--activation-reserve-bytes", type=Text(),
              help="Activation peak per rank [default: estimate on the engine's warmup].")
@click.option("--non-torch-bytes", type=Text(),
              help="Memory outside PyTorch per rank (CUDA context, NCCL) [default: estimate].")
@click.option("--cudagraph-bytes", type=Text(), help="vLLM's CUDA-graph reserve per rank [default: estimate].")
@click.option("--dtype", type=Text(64), help="Precision of the weights that are not quantized [default: the config's].")
@click.option("--quantization", type=click.Choice(QUANTIZATION_METHODS, case_sensitive=False),
              help="Weight quantization [default: the config's quantization_config].")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES, case_sensitive=False),
              help="KV cache precision [default: the model's].")
@click.option("--tp", type=click.IntRange(min=1, max=1 << 20), default=1, show_default=True,
              help="Tensor parallel size.")
@click.option("--pp", type=click.IntRange(min=1, max=1 << 20), default=1, show_default=True,
              help="Pipeline parallel size.")
@click.option("--block-size", type=int_range(1, MAX_BLOCK_TOKENS),
              help="Tokens per KV block [default: 256 nano-vllm, 64 vLLM 0.34, 16 vLLM 0.33, 1 SGLang].")
@click.option("--seqs", type=int_range(1, MAX_TARGET), help="Target: resident sequences (with --seq-len).")
@click.option("--seq-len", type=int_range(1, MAX_TARGET), help="Target: cached tokens per sequence.")
@click.option("--tokens", type=int_range(1, MAX_TARGET), help="Target: cached tokens summed over resident sequences.")
@click.option("--max-num-batched-tokens", type=int_range(1), help="Largest prefill, for the activation estimate "
              "[default: the engine's].")
@click.option("--max-num-seqs", type=int_range(1), help="Most sequences per step [default: the engine's].")
@click.option("--run", "run", type=RUN_REF, help="Compare a recorded run (id or 'latest') with its plan.")
@db_option
@json_option
@click.pass_context
def plan(ctx: click.Context, model: str, engine: str, engine_version: str | None, extensible_kv_cache: bool | None,
         gpu_memory: str | None, utilization: float | None,
         kv_cache_memory_bytes: str | None, weights_bytes: str | None, activation_reserve_bytes: str | None,
         non_torch_bytes: str | None, cudagraph_bytes: str | None, dtype: str | None, quantization: str | None,
         kv_dtype: str | None, tp: int, pp: int, block_size: int | None, seqs: int | None, seq_len: int | None,
         tokens: int | None, max_num_batched_tokens: int | None, max_num_seqs: int | None, run: str | None,
         db_path: Path | None, as_json: bool) -> None:
    """Plan KV-cache capacity per rank from a model config, or compare a run with its plan.

    Exits 1 when the target load does not fit (or the engine would refuse to start).

    \b
    memwatch plan --gpu-memory 24GiB --seqs 4 --seq-len 32768
    memwatch plan --model meta-llama/Llama-3.1-8B-Instruct --engine vllm --gpu-memory 80GB --tokens 500000
    memwatch plan --model hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4 --gpu-memory 24GiB --json
    memwatch plan --run latest
    """
    try:
        if run is not None:
            _refuse_planning_options(ctx)
            _plan_run(db_path, run, as_json)
            return
        inputs = PlanInputs(
            gpu_memory_bytes=_gpu_memory(gpu_memory), utilization=utilization,
            kv_cache_memory_bytes=_size(kv_cache_memory_bytes), weights_bytes=_size(weights_bytes),
            activation_reserve_bytes=_size(activation_reserve_bytes), non_torch_bytes=_size(non_torch_bytes),
            cudagraph_bytes=_size(cudagraph_bytes), dtype=dtype, kv_dtype=kv_dtype,
            quantization=quantization, tp=tp, pp=pp, block_size=block_size, seqs=seqs, seq_len=seq_len,
            tokens=tokens, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            engine=engine, engine_version=engine_version, extensible_kv_cache=extensible_kv_cache,
        )
        result = plan_capacity(ModelSpec.load(model), inputs)
    except MemwatchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(render_plan(result))
    if result.fits is False or result.startup_error:
        sys.exit(DOES_NOT_FIT)


command = plan
"""The name the ``memwatch`` group registers commands under."""
