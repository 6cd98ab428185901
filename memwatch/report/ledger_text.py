"""The printed ledger: lines that visibly sum, each term in readable units and in exact bytes.

Every command that prints a ledger (``demo`` at sizing, ``check`` at a run's last sample) builds it
from :class:`LedgerLine` rows: a first line, terms subtracted from it, and the line they leave. The
exact-bytes column lets a reader add the lines up by hand; lines outside the sum come after, marked so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from memwatch.ledger import LedgerTerms
from memwatch.units import format_bytes

SUM_TERMS: tuple[tuple[str, str], ...] = (
    ("non_torch_bytes", "non-PyTorch (used − reserved)"),
    ("weights_bytes", "weights"),
    ("torch_other_bytes", "other long-lived PyTorch"),
    ("kv_bytes", "KV cache"),
    ("activation_reserve_bytes", "activation reserve (warmup peak − current)"),
)
"""The terms a budget splits into, with their printed names; what is left is the headroom."""

OUTSIDE_TERMS: tuple[tuple[str, str, str], ...] = (
    ("cache_slack_bytes", "cache slack (reserved − allocated)",
     "outside the sum: cached, reused for activations within the reserve"),
    ("reclaimable_cache_bytes", "  of it reclaimable", "whole free segments: released before an OOM"),
    ("pinned_cache_bytes", "  of it pinned", "free splits of used segments: fragmentation"),
    ("torch_kept_bytes", "other long-lived PyTorch now",
     "outside the sum: allocated − weights − KV after the step; rising is a leak inside PyTorch"),
    ("residual_bytes", "residual", "outside the sum: headroom now − headroom at sizing"),
    ("oom_margin_bytes", "OOM margin", "outside the sum: free after a worst-case forward"),
)


class LedgerLine(NamedTuple):
    sign: str
    """``""`` for the first line, ``−`` for a term taken from it, ``=`` for what is left, ``·`` outside the sum."""
    label: str
    value: int | None
    note: str = ""


def terms_lines(terms: LedgerTerms, basis: str = "total × utilization") -> list[LedgerLine]:
    """A sample's ledger: budget − each term = headroom, then the quantities outside the sum.

    ``basis`` names what the budget is under the engine's rule (:attr:`memwatch.ledger.Sizing.budget_basis`)."""
    lines = [LedgerLine("", f"budget ({basis})", terms.budget_bytes)]
    lines += [LedgerLine("−", label, getattr(terms, key)) for key, label in SUM_TERMS]
    lines.append(LedgerLine("=", "headroom (left in the budget)", terms.headroom_bytes))
    lines += [LedgerLine("·", label, getattr(terms, key), note) for key, label, note in OUTSIDE_TERMS]
    return lines


def render_lines(lines: Sequence[LedgerLine], indent: str = "  ") -> list[str]:
    """Aligned text: sign, name, readable size, exact bytes, note."""
    width = max(len(line.label) for line in lines)
    exact_width = max(len(_exact(line.value)) for line in lines)
    out = []
    for line in lines:
        sign = " " if line.sign in ("", "·") else line.sign
        text = (f"{indent}{sign} {line.label:<{width}}  {format_bytes(line.value):>11}  "
                f"{_exact(line.value):>{exact_width}}")
        out.append(f"{text}  {line.note}".rstrip() if line.note else text)
    return out


def _exact(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"
