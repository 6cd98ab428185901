"""KV block counts that disagree: between the ranks of one run, or with the engine's own rule.

Every rank of one tensor-parallel engine must size the same number of KV blocks (the scheduler
hands out block ids once for all of them); data-parallel engines have a scheduler each, so ranks are
compared within their engine (a ``rank_identity`` event's ``dp_rank``; engine 0 without one). And
the count a rank reports must be what the engine's sizing rule gives on the readings it reports, or
the ledger's accounting of that rank does not hold (checked for the rules memwatch knows).
``block_count_mismatch`` is raised once per distinct disagreement: the set of different counts an
engine's ranks sized at one moment. A rank that sizes later with a count already seen joins that
disagreement (no second flag naming another set of ranks); a flag is raised again only when a count
no rank had sized there appears (a rank re-sizes, or sizes a third count). Ranks are compared at the
same sizing moment (``sizing_event`` of the ``kv_allocated`` data: SGLang sizes again after
CUDA-graph capture), so a rank that resized is not set against one whose resize has not been read yet.
"""

from __future__ import annotations

from memwatch.detectors.base import make_flag
from memwatch.detectors.wording import format_bytes, format_count
from memwatch.flags import BLOCK_COUNT_MISMATCH, WARNING, Flag
from memwatch.kv_sizing import Sizing
from memwatch.records import Event


class BlockCountCheck:
    """``block_count_mismatch`` for one run, fed every rank's KV sizing."""

    __slots__ = ("_blocks_by_rank", "_engine_by_rank", "_moment_by_rank", "_reported")

    def __init__(self) -> None:
        self._blocks_by_rank: dict[int, int] = {}
        self._moment_by_rank: dict[int, object] = {}
        self._engine_by_rank: dict[int, int] = {}
        self._reported: set[tuple[int, object, frozenset[int]]] = set()

    def on_identity(self, event: Event) -> None:
        """A ``rank_identity`` event: which data-parallel engine the rank belongs to."""
        data = event.data if isinstance(event.data, dict) else {}
        dp_rank = data.get("dp_rank")
        if isinstance(dp_rank, int) and not isinstance(dp_rank, bool):
            self._engine_by_rank[event.rank] = dp_rank

    def on_sizing(self, event: Event, sizing: Sizing) -> list[Flag]:
        """Flags for the sizing a ``kv_allocated`` event of one rank announced."""
        flags = []
        formula_flag = self._check_formula(event, sizing)
        if formula_flag is not None:
            flags.append(formula_flag)
        if sizing.num_blocks is not None:
            self._blocks_by_rank[event.rank] = sizing.num_blocks
            self._moment_by_rank[event.rank] = _moment(event)
            ranks_flag = self._check_ranks(event, sizing)
            if ranks_flag is not None:
                flags.append(ranks_flag)
        return flags

    @staticmethod
    def _check_formula(event: Event, sizing: Sizing) -> Flag | None:
        expected = sizing.formula_blocks
        actual = sizing.num_blocks
        if expected is None or actual is None or expected == actual:
            return None
        difference = actual - expected
        block_bytes: int = sizing.block_bytes  # type: ignore[assignment]  # formula_blocks needs it
        rule = "its explicit KV size" if sizing.checked_by == "explicit" else "its own sizing rule"
        unit = "tokens" if sizing.kv_unit == "token" else "blocks"
        return make_flag(
            event, BLOCK_COUNT_MISMATCH, WARNING,
            f"rank {event.rank} sized {format_count(actual)} KV {unit} but {rule} gives "
            f"{format_count(expected)} on its own readings ({difference:+,} {unit}, "
            f"{format_bytes(difference * block_bytes)})",
            {"num_blocks": actual, "formula_blocks": expected, "difference_blocks": difference,
             "difference_bytes": difference * block_bytes, "block_bytes": block_bytes},
        )

    def _check_ranks(self, event: Event, sizing: Sizing) -> Flag | None:
        engine, moment = self._engine_by_rank.get(event.rank, 0), _moment(event)
        counts = {rank: blocks for rank, blocks in self._blocks_by_rank.items()
                  if self._engine_by_rank.get(rank, 0) == engine and self._moment_by_rank.get(rank) == moment}
        if len(set(counts.values())) < 2:
            return None
        disagreement = (engine, moment, frozenset(counts.values()))
        if disagreement in self._reported:
            return None
        self._reported.add(disagreement)
        signature = tuple(sorted(counts.items()))
        fewest, most = min(counts.values()), max(counts.values())
        spread = most - fewest
        block_bytes = sizing.block_bytes
        spread_bytes = None if block_bytes is None else spread * block_bytes
        listing = ", ".join(f"rank {rank}: {format_count(blocks)}" for rank, blocks in signature)
        return make_flag(
            event, BLOCK_COUNT_MISMATCH, WARNING,
            f"the ranks of this run sized different KV block counts ({listing}): only the smallest, "
            f"{format_count(fewest)}, is safe to schedule on all of them",
            {"num_blocks_by_rank": {str(rank): blocks for rank, blocks in signature}, "fewest_blocks": fewest,
             "most_blocks": most, "spread_blocks": spread, "spread_bytes": spread_bytes,
             "block_bytes": block_bytes},
        )


def _moment(event: Event) -> object:
    """Which sizing of a rank a ``kv_allocated`` event is (``None``: the first; ``"post_capture"``: SGLang's resize)."""
    data = event.data if isinstance(event.data, dict) else {}
    return data.get("sizing_event")
