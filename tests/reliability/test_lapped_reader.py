"""A reader lapped by a writer at full speed: torn copies are read again, never taken for a corrupt ring."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from memwatch_engine.ring_reader import RingReader

CAPACITY = 256
WRITER = """
import sys, time
from memwatch_engine.ring import RingWriter
w = RingWriter(sys.argv[1], run_id="lap", capacity={capacity})
print("ready", flush=True)
step = 0
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    for _ in range(100):
        step += 1
        w.write_sample(step, step, 5, 2, 0, 3 * step, step + 1, 0, 0, 0, 0, 0, 0, 0)
        if step % 7 == 0:  # an event of six chunks, filled before it is published
            w.write_event(step, step, "tick", {{"step": step, "pad": "x" * 500}})
w.close()
"""


def test_a_lapped_reader_never_drops_the_ring_or_returns_a_torn_record(tmp_path: Path) -> None:
    path = tmp_path / "lap-r0.ring"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(capacity=CAPACITY, seconds=4), str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reader = RingReader(path)
        drains = lapped = records = empty = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and writer.poll() is None:
            published = reader.published
            cursor = max(0, published - 2 * CAPACITY)  # far behind: the writer laps this reader every time
            drained = reader.drain(cursor)  # before the fix: "slots hold records ..., expected ..." now and then
            drains += 1
            lapped += drained.lost > 0
            empty += not drained.samples and not drained.events
            records += len(drained.samples) + len(drained.events)
            seqs = [s[0] for s in drained.samples]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            for s in drained.samples:  # every field of a record from the same write
                assert s[7] == 3 * s[5] and s[8] == s[5] + 1, s
            for _seq, step, ts_ns, kind, data in drained.events:
                assert kind == "tick" and data["step"] == step == ts_ns and data["pad"] == "x" * 500
            assert drained.next_cursor >= cursor + drained.lost
        reader.close()
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    print(f"\nlapped reader: {drains} drains, {lapped} lapped, {empty} empty (torn, retried), {records} records")
    assert lapped > 500 and records > 0
