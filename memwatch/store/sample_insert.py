"""The statement that stores one drain of a ring's samples as the ring's own tuples, fitted to the drain.

The ring marks a reading it could not take as ``-1``, which the store keeps as NULL. ``NULLIF(?, -1)`` on
every such column costs SQLite a function call per column per row, an eighth of the whole insert; yet a
serving engine's samples mostly have every reading. So each drain is looked at in its copied slots, at C
speed: a column whose most significant byte is ``0xFF`` in no slot holds no negative number, and is bound as
it is; the others keep ``NULLIF``. A drain whose samples are all in one phase gets the phase's name as a
constant instead of a ``CASE`` over the codes. Event slots hold other bytes at those places: at worst they
keep a ``NULLIF`` or a ``CASE`` that was not needed, never drop one that was.
"""

from __future__ import annotations

from memwatch_engine.ring import RECORD_SIZE

NULLABLE_FIELDS: dict[int, int] = {
    7: 32 + 7, 8: 40 + 7, 9: 48 + 7, 10: 56 + 7, 11: 64 + 7, 12: 72 + 7,  # allocator and driver bytes, tokens
    13: 80 + 3, 14: 84 + 3, 15: 88 + 3, 16: 92 + 3,                        # KV blocks, sequences, segments
    17: 96 + 7, 18: 104 + 7, 19: 112 + 3, 20: 116 + 3,                     # active, inactive split, retries, OOMs
}
"""Ring sample fields stored as NULL when ``-1``, by position in the sample tuple, with the offset of the
value's most significant byte in its slot (little-endian: 8-byte fields end 7 bytes on, 4-byte ones 3)."""
_PHASE_AT = 10
"""The phase code's offset in a sample slot."""


def nullable_fields(slots: bytes) -> frozenset[int]:
    """The fields that may hold ``-1`` in some slot of ``slots`` (all of them when there are no slots)."""
    if not slots:
        return frozenset(NULLABLE_FIELDS)
    return frozenset(at for at, top in NULLABLE_FIELDS.items() if 0xFF in slots[top::RECORD_SIZE])


def single_phase(slots: bytes) -> int | None:
    """The phase code of every slot, where they all have the same one; else ``None``."""
    codes = slots[_PHASE_AT::RECORD_SIZE]
    return codes[0] if codes and codes.count(codes[0]) == len(codes) else None


def raw_sample_insert(run_id: str, rank: int, phase_names: dict[int, str | None], ring_version: int = 2,
                      run_key: int | None = None, *, nullable: frozenset[int] = frozenset(NULLABLE_FIELDS),
                      phase: int | None = None) -> str:
    """An INSERT that stores ring sample tuples exactly as ``RingReader.drain`` returns them.

    The ring's fields are bound by position (``?6`` is the step, ``?8`` the allocated bytes, …; 16 of
    them from a version 1 ring, whose allocator signals are stored as NULL, 21 from version 2); the
    run's key and the rank are in the statement and the phase and step-kind codes are mapped by
    ``CASE``, so no Python code touches each row on its way into SQLite. The rows go straight to
    ``sample_rows`` (the run's ``runs`` row is registered before its first samples). The run's key is
    looked up in ``runs`` for every row until the caller knows it (``run_key``, once registered):
    that lookup is about a sixth of the insert's cost. Fields outside ``nullable`` are bound without
    ``NULLIF`` (:func:`nullable_fields`); ``phase``, the code every sample has, is stored as its name.
    """
    def value(at: int) -> str:
        return f"NULLIF(?{at + 1}, -1)" if at in nullable else f"?{at + 1}"

    if phase is None:
        codes = " ".join(f"WHEN {int(code)} THEN {_sql_text(name)}" for code, name in phase_names.items() if name)
        phase_value = f"CASE ?4 {codes} END"
    else:
        name = phase_names.get(phase)
        phase_value = _sql_text(name) if name else "NULL"
    key = str(int(run_key)) if run_key is not None else f"(SELECT run_key FROM runs WHERE run_id = {_sql_text(run_id)})"
    signals = ", ".join(value(at) for at in range(16, 21)) if ring_version >= 2 else "NULL, NULL, NULL, NULL, NULL"
    return (
        "INSERT INTO sample_rows (run_key, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
        " driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens,"
        " step_kind, peak_is_step, process_used_bytes, segments, active_bytes, inactive_split_bytes,"
        f" alloc_retries, num_ooms, seq) VALUES ({key}, {int(rank)}, ?6, ?7, {phase_value},"
        f" {', '.join(value(at) for at in (7, 8, 9, 10, 11, 13, 14, 15, 12))},"
        f" CASE ?5 WHEN 1 THEN 'prefill' WHEN 2 THEN 'decode' END, ?3 & 1, NULL, {signals}, ?1)"
        " -- ?2 type unused"
    )


def _sql_text(value: str) -> str:
    return "'" + str(value).replace("\0", "").replace("'", "''") + "'"
