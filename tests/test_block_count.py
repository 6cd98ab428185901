"""``block_count_mismatch`` across ranks, fed by hand: which engine a rank belongs to, which sizing moment, and
the spread's bytes when the block size is unknown."""

from __future__ import annotations

from typing import Any

from memwatch.detectors.block_count import BlockCountCheck
from memwatch.kv_sizing import sizing_of
from memwatch.records import Event

MiB = 1 << 20


def _sized(check: BlockCountCheck, rank: int, blocks: int, **data: Any) -> list[Any]:
    event = Event("r", rank, 3, 1000 + rank, "kv_allocated", {"num_blocks": blocks, "block_bytes": 2 * MiB, **data})
    return check.on_sizing(event, sizing_of(event.data))


def _identity(check: BlockCountCheck, rank: int, data: object) -> None:
    check.on_identity(Event("r", rank, 0, 1, "rank_identity", data))  # type: ignore[arg-type]


def test_only_an_integer_dp_rank_moves_a_rank_to_another_engine() -> None:
    check = BlockCountCheck()
    _identity(check, 1, {"dp_rank": 1})
    assert _sized(check, 0, 100) == [] and _sized(check, 1, 90) == []  # two engines: nothing to compare
    for odd in ({"dp_rank": True}, {"dp_rank": "1"}, ["dp_rank", 1], None):
        check = BlockCountCheck()
        _identity(check, 1, odd)
        _sized(check, 0, 100)
        [flag] = _sized(check, 1, 90)  # still engine 0: compared with rank 0
        assert flag.data["num_blocks_by_rank"] == {"0": 100, "1": 90}


def test_ranks_are_compared_at_the_same_sizing_moment_and_an_unknown_block_size_has_no_bytes() -> None:
    check = BlockCountCheck()
    _sized(check, 0, 100)
    assert _sized(check, 1, 90, sizing_event="post_capture") == []  # rank 0 has not resized yet
    [flag] = _sized(check, 0, 80, sizing_event="post_capture")
    assert flag.rank == 0 and flag.data == {
        "num_blocks_by_rank": {"0": 80, "1": 90}, "fewest_blocks": 80, "most_blocks": 90, "spread_blocks": 10,
        "spread_bytes": 20 * MiB, "block_bytes": 2 * MiB}
    check = BlockCountCheck()
    event = Event("r", 0, 3, 1000, "kv_allocated", {"num_blocks": 100})
    check.on_sizing(event, sizing_of(event.data))
    event = Event("r", 1, 3, 1001, "kv_allocated", {"num_blocks": 96})
    [flag] = check.on_sizing(event, sizing_of(event.data))
    assert flag.data["spread_bytes"] is None and flag.data["block_bytes"] is None
    assert flag.message == ("the ranks of this run sized different KV block counts (rank 0: 100, rank 1: 96): only "
                            "the smallest, 96, is safe to schedule on all of them")
    event = Event("r", 2, 3, 1002, "kv_allocated", "not a dict")  # type: ignore[arg-type]
    assert check.on_sizing(event, sizing_of({})) == []  # no count sized: nothing compared


def test_ranks_of_a_second_engine_are_compared_among_themselves() -> None:
    check = BlockCountCheck()
    for rank in (1, 2):
        _identity(check, rank, {"dp_rank": 1})
    assert _sized(check, 0, 100) == [] and _sized(check, 1, 90) == []
    [flag] = _sized(check, 2, 80)
    assert flag.data["num_blocks_by_rank"] == {"1": 90, "2": 80}  # engine 1 only; rank 0 is engine 0's
    event = Event("r", 3, 3, 1003, "kv_allocated", "not a dict")  # type: ignore[arg-type]
    assert check.on_sizing(event, sizing_of({"num_blocks": 100})) == []  # the first sizing moment, engine 0
