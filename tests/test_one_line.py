"""Every text another user chose reaches a log line or a label as one line, and a name with a newline is no name.

A ring's file name, a run id and the engine's identity are written by someone else; a newline in one used to
start a line of its author's choosing in the sidecar's log, and ``valid_name`` took ``vllm-0\\n`` (``$`` matches
before a final newline), exported as ``pod="vllm-0\\x0a"``.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest

from memwatch.identity import place_from_meta
from memwatch.log_lines import OneLineFormatter, configure
from memwatch_engine.identity import valid_name
from memwatch_engine.ring import RUN_ID_PATTERN, RingWriter

from processes import SidecarProcess, wait_for

FORGED = "2026-01-01 00:00:00,000 memwatch.serve INFO run admin stored"
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}


@pytest.mark.parametrize("name", ["vllm-0\n", "vllm-0\r\n", "prod\n", "a\nb"])
def test_a_name_with_a_newline_anywhere_is_refused(name: str) -> None:
    assert valid_name(name) is None
    assert place_from_meta({"where": {"k8s_pod": name, "k8s_namespace": "prod"}}) == {"k8s_namespace": "prod"}


def test_a_run_id_ending_in_a_newline_is_refused() -> None:
    assert RUN_ID_PATTERN.match("run-1") and not RUN_ID_PATTERN.match("run-1\n")
    with pytest.raises(ValueError, match="must be 1-16 letters"):
        RingWriter("/nonexistent/x.ring", run_id="run-1\n", meta=META, capacity=256)


def test_the_formatter_writes_a_quoted_newline_as_an_escape_and_indents_a_traceback() -> None:
    record = logging.LogRecord("memwatch.collector", logging.WARNING, __file__, 1, "ignoring ring %s: %s",
                               (f"x\n{FORGED}\x1b[2J.ring", "why"), None)
    assert OneLineFormatter("%(levelname)s %(message)s").format(record) == (
        f"WARNING ignoring ring x\\x0a{FORGED}\\x1b[2J.ring: why")
    try:
        raise OSError(f"bad\n{FORGED}")
    except OSError as exc:
        failed = logging.LogRecord("memwatch.serve", logging.ERROR, __file__, 1, "failed", (),
                                   (OSError, exc, exc.__traceback__))
    lines = OneLineFormatter("%(levelname)s %(message)s").format(failed).split("\n")
    assert lines[0] == "ERROR failed"
    assert all(line.startswith("    ") for line in lines[1:]) and lines[-1] == f"    {FORGED}"
    traceback = logging.Formatter().formatException(failed.exc_info).split("\n")  # type: ignore[arg-type]
    assert lines[1:] == [f"    {line}" for line in traceback]  # each line whole, indented, nothing between


def test_every_command_logs_one_timestamped_line_per_record_to_stderr_at_its_level() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = []  # as in a fresh process: basicConfig does nothing where the root has a handler
    try:
        configure(logging.INFO)
        handlers = root.handlers[:]
        said = root.level
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    assert said == logging.INFO and len(handlers) == 1 and type(handlers[0]) is logging.StreamHandler
    assert handlers[0].stream is sys.stderr
    record = logging.LogRecord("memwatch.serve", logging.INFO, __file__, 1, "run %s stored", (f"r1\n{FORGED}",),
                               None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} memwatch\.serve INFO run r1\\x0a" + re.escape(FORGED)
                        + " stored", handlers[0].format(record)), handlers[0].format(record)


def test_the_log_tail_a_bundle_carries_is_one_line_per_record() -> None:
    from memwatch.incident.triggers import LogTail

    tail = LogTail(lines=10)
    tail.emit(logging.LogRecord("memwatch.collector", logging.WARNING, __file__, 1, "ignoring ring %s",
                                (f"x\n{FORGED}.ring",), None))
    lines = tail.tail().decode().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"ignoring ring x\\x0a{FORGED}.ring")


def test_a_ring_named_with_a_newline_does_not_forge_a_line_in_the_sidecars_log(runtime_dir: Path,
                                                                              db_path: Path) -> None:
    name = f"x\n{FORGED}\n.ring"
    ring = RingWriter(runtime_dir / name, run_id="r1", meta=META, capacity=256, mode=0o644)  # refused: any may read
    try:
        with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
            wait_for(lambda: list(runtime_dir.glob("*.ring")), what="the ring")
            time.sleep(1.5)  # a few scans
            output = sidecar.stop()
    finally:
        ring.close()
    lines = output.splitlines()
    assert not any(line.startswith(FORGED) for line in lines), output
    refused = [line for line in lines if "ignoring ring" in line]
    assert len(refused) == 1 and f"x\\x0a{FORGED}\\x0a.ring: mode 644 lets every user read it" in refused[0], output
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} memwatch\.collector WARNING ", refused[0])
