"""The largest allocator peak of a rank from a moment on, read from both resolutions of a real store."""

from __future__ import annotations

from pathlib import Path

from memwatch.store import open_store
from memwatch.store.sample_peaks import peak_since
from memwatch.store.schema import ENSURE_RUN

GiB = 1 << 30


def test_the_peak_from_a_moment_on_over_rows_and_rolled_up_seconds(tmp_path: Path) -> None:
    db = open_store(tmp_path / "peaks.db")
    db.execute(ENSURE_RUN, ("run1", "run1"))
    key = db.execute("SELECT run_key FROM runs WHERE run_id = 'run1'").fetchone()[0]
    # Rank 0: rows at t = 10 (9 GiB), 20 (4 GiB), 30 (no peak read); a rolled-up second spanning t = 1..15 whose
    # largest peak is 7 GiB, and one spanning 40..45 at 6 GiB. Rank 1: one row at t = 50 (8 GiB).
    for rank, ts, peak in ((0, 10, 9 * GiB), (0, 20, 4 * GiB), (0, 30, None), (1, 50, 8 * GiB)):
        db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, peak_bytes) VALUES ('run1', ?, 0, ?, ?)",
                   (rank, ts, peak))
    for second, first, last, peak in ((0, 1, 15, 7 * GiB), (1, 40, 45, 6 * GiB)):
        db.execute("INSERT INTO sample_seconds (run_key, rank, second, samples, first_ts_ns, last_ts_ns,"
                   " max_peak_bytes) VALUES (?, 0, ?, 5, ?, ?, ?)", (key, second, first, last, peak))
    db.conn.commit()
    assert peak_since(db, "run1", 0, 10) == 9 * GiB    # the row at the moment itself counts
    assert peak_since(db, "run1", 0, 11) == 7 * GiB    # the second ending at 15 is kept whole
    assert peak_since(db, "run1", 0, 15) == 7 * GiB
    assert peak_since(db, "run1", 0, 16) == 6 * GiB    # the row at 20 (4 GiB) and the later second (6 GiB)
    assert peak_since(db, "run1", 0, 41) == 6 * GiB    # a second is judged by its end
    assert peak_since(db, "run1", 0, 46) is None       # nothing after: no peak, not 0
    assert peak_since(db, "run1", 1, 0) == 8 * GiB     # each rank its own
    assert peak_since(db, "run1", 2, 0) is None
    assert peak_since(db, "other", 0, 0) is None       # an unknown run
