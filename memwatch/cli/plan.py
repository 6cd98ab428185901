"""``memwatch plan``: how much KV cache a rank holds and whether a target load fits; or, with
``--run``, a recorded run's plan against what its engine measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import MemwatchError
from ..models.spec import ModelSpec
from ..plan.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, PlanInputs, plan_capacity
from ..plan.observed import compare_run
from ..plan.report import render_observed, render_plan
from ..plan.runs import load_run
from ..units import parse_bytes
from .options import db_option, json_option

KV_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


def _size(value: str | None) -> int | None:
    return None if value is None else parse_bytes(value)


def _plan_run(db_path: Path | None, run: str, as_json: bool) -> None:
    record, events = load_run(db_path, run)
    comparisons = compare_run(record, events)
    if as_json:
        click.echo(json.dumps([comparison.to_dict() for comparison in comparisons], indent=2))
    else:
        click.echo(render_observed(comparisons))


@click.command("plan")
@click.option("--model", "model", default="Qwen2.5-7B-Instruct", show_default=True,
              help="config.json, a directory holding one, or a shipped model name.")
@click.option("--gpu-memory", help="Device bytes per rank: 25769803776, 24GiB (2^30) or 24GB (10^9).")
@click.option("--utilization", type=float, help="Share of the device the engine may use [default: 0.9].")
@click.option("--kv-cache-memory-bytes", help="Explicit KV bytes per rank; replaces --utilization.")
@click.option("--weights-bytes", help="Weight bytes per rank [default: parameters × --dtype].")
@click.option("--non-kv-bytes", help="Other non-KV peak per rank [default: activation estimate].")
@click.option("--dtype", help="Weight precision [default: the config's].")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES, case_sensitive=False),
              help="KV cache precision [default: the model's].")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline parallel size.")
@click.option("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, show_default=True,
              help="Tokens per KV block.")
@click.option("--seqs", type=int, help="Target: resident sequences (with --seq-len).")
@click.option("--seq-len", type=int, help="Target: cached tokens per sequence.")
@click.option("--tokens", type=int, help="Target: cached tokens summed over resident sequences.")
@click.option("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
              show_default=True, help="Largest prefill, for the activation estimate.")
@click.option("--run", "run", help="Compare a recorded run (id or 'latest') with its plan.")
@db_option
@json_option
def plan(model: str, gpu_memory: str | None, utilization: float | None, kv_cache_memory_bytes: str | None,
         weights_bytes: str | None, non_kv_bytes: str | None, dtype: str | None, kv_dtype: str | None,
         tp: int, pp: int, block_size: int, seqs: int | None, seq_len: int | None, tokens: int | None,
         max_num_batched_tokens: int, run: str | None, db_path: Path | None, as_json: bool) -> None:
    """Plan KV-cache capacity per rank from a model config, or compare a run with its plan.

    \b
    memwatch plan --gpu-memory 24GiB --weights-bytes 15GiB --non-kv-bytes 2GiB --seqs 4 --seq-len 32768
    memwatch plan --model Llama-3.1-8B-Instruct --gpu-memory 80GB --tp 2 --tokens 500000 --json
    memwatch plan --run latest
    """
    try:
        if run is not None:
            _plan_run(db_path, run, as_json)
            return
        inputs = PlanInputs(
            gpu_memory_bytes=_size(gpu_memory), utilization=utilization,
            kv_cache_memory_bytes=_size(kv_cache_memory_bytes), weights_bytes=_size(weights_bytes),
            non_kv_bytes=_size(non_kv_bytes), dtype=dtype, kv_dtype=kv_dtype, tp=tp, pp=pp,
            block_size=block_size, seqs=seqs, seq_len=seq_len, tokens=tokens,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        result = plan_capacity(ModelSpec.load(model), inputs)
    except MemwatchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(render_plan(result))


command = plan
"""The name the ``memwatch`` group registers commands under."""
