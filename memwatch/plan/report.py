"""Plain-text rendering of a capacity plan and of plan versus observed, readable on 80 columns.

Every byte count is printed exactly (with thousands separators) next to its binary-unit form, so no
reader has to guess whether "GB" meant 10^9 or 2^30.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from memwatch.plan.capacity import CapacityPlan
from memwatch.plan.observed import PlanVsObserved
from memwatch.units import format_bytes, format_bytes_si


def _line(label: str, num_bytes: int, note: str = "") -> str:
    text = f"{label:<26}{num_bytes:>16,} B  {format_bytes(num_bytes):>11}"
    return f"{text}  {note}" if note else text


def _budget_lines(plan: CapacityPlan) -> list[str]:
    lines = []
    for line in plan.ledger:
        label = f"{line.op} {line.label}" if line.op else line.label
        note = line.note
        if line.label == "GPU memory":
            note = f"= {format_bytes_si(line.num_bytes)}"
        text = _line(label, line.num_bytes)
        if note and len(text) + 2 + len(note) <= 80:
            lines.append(f"{text}  {note}")
            continue
        lines.append(text)
        if note:
            lines += textwrap.wrap(note, width=76, initial_indent="    ", subsequent_indent="    ")
    if plan.kv_budget_bytes < 0:
        lines.append("  weights and the other terms exceed the budget: no room for any KV cache")
    if plan.startup_error:
        lines += textwrap.wrap(plan.startup_error, width=78, initial_indent="  ", subsequent_indent="  ")
    return lines


def _state_lines(plan: CapacityPlan) -> list[str]:
    if not plan.state_bytes_per_seq:
        return []
    return [_line("state per sequence", plan.state_bytes_per_seq),
            *textwrap.wrap(plan.state_note, width=76, initial_indent="    ", subsequent_indent="    ")]


def render_plan(plan: CapacityPlan) -> str:
    """The ledger, the load table and the verdict, as lines of text."""
    rank = f"tp {plan.tp}, pp {plan.pp}"
    lines = [
        f"plan for {plan.model} ({plan.attention_kind}) on {_engine(plan)}, per rank at {rank}",
        f"weights {plan.dtype}, KV cache {plan.kv_dtype}, blocks of {plan.block_size} tokens"
        + (", extensible" if plan.extensible_kv_cache else ""),
        "",
        _line("KV per token", plan.kv_bytes_per_token),
        _line("KV block", plan.block_bytes),
        *_state_lines(plan),
        "",
        *_budget_lines(plan),
        f"{'KV blocks':<26}{plan.kv_blocks:>16,}    ({plan.ideal_kv_blocks:,.2f} ideal)",
        f"{'resident tokens':<26}{plan.max_resident_tokens:>16,}    "
        f"({plan.ideal_max_resident_tokens:,} ideal)",
    ]
    if plan.seq_len is not None and plan.seq_kv_bytes is not None:
        lines += ["", f"sequences of {plan.seq_len:,} tokens: {format_bytes(plan.seq_kv_bytes)} of KV each "
                  f"({format_bytes(plan.ideal_seq_kv_bytes or 0)} ideal)",
                  f"max concurrency: {plan.max_concurrent_seqs:,} sequences "
                  f"({plan.ideal_max_concurrent_seqs:,} ideal)"]
    if plan.table:
        lines += ["", f"  {'resident seqs':>13}  {'KV bytes':>12}  {'ideal':>12}  fits?"]
        lines += [f"  {row.seqs:>13,}  {format_bytes(row.kv_bytes):>12}  {format_bytes(row.ideal_kv_bytes):>12}"
                  f"  {'yes' if row.fits else 'no'}" for row in plan.table]
    if plan.required_kv_bytes is not None:
        target = (f"{plan.seqs:,} × {plan.seq_len:,} tokens" if plan.seqs is not None
                  else f"{plan.tokens:,} cached tokens")
        short = plan.shortfall_bytes or 0
        verdict = ("verdict: fits" if plan.fits
                   else f"verdict: does not fit, short by {format_bytes(short)} ({short:,} B)")
        # the budget the ledger above ends with, negative included: the shortfall is required − budget
        lines += ["", verdict, f"  {target} need {format_bytes(plan.required_kv_bytes)} of KV; "
                  f"the KV budget is {format_bytes(plan.kv_budget_bytes)}"]
    return "\n".join(lines)


def render_observed(comparisons: Sequence[PlanVsObserved]) -> str:
    """Predicted against measured, per ledger term, with the cause of each difference."""
    lines: list[str] = []
    for comparison in comparisons:
        if lines:
            lines.append("")
        warmup = (f"warmup {comparison.warmup_seqs} × {comparison.warmup_seq_len:,} tokens" if comparison.warmup_seqs
                  else "no warmup forward before sizing")
        lines += [
            f"run {comparison.run_id} rank {comparison.rank}: {comparison.model}, "
            f"{format_bytes(comparison.total_bytes)} × {comparison.utilization:g}; {warmup}",
            "",
            f"{'term':<20}{'predicted':>13}{'measured':>13}{'difference':>13}",
        ]
        for term in comparison.terms:
            lines.append(f"{term.term:<20}{format_bytes(term.predicted_bytes):>13}"
                         f"{format_bytes(term.measured_bytes):>13}{format_bytes(term.diff_bytes):>13}")
            if term.predicted_blocks is not None:
                unit = "tokens" if term.term == "KV tokens" else "blocks"
                predicted, measured = f"{term.predicted_blocks:,} {unit}", f"{term.measured_blocks or 0:,} {unit}"
                lines.append(f"{'':<20}{predicted:>13}{measured:>13}")
            lines += textwrap.wrap(term.cause, width=78, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)


def _engine(plan: CapacityPlan) -> str:
    """The engine, with the vLLM release planned for."""
    return plan.engine if plan.engine_version is None else f"{plan.engine} {plan.engine_version}"
