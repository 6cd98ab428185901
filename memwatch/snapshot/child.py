"""The reading child of :mod:`.untrusted`: limits first, then the snapshot from stdin, JSON to stdout.

Exit codes: 0 with ``{"ok": ...}`` on stdout; 3 when the memory limit was hit. The CPU limit ends
it with ``SIGXCPU`` (then ``SIGKILL``); the parent kills it past the wall-time limit.
"""

from __future__ import annotations

import json
import os
import resource
import sys

from memwatch.errors import UsageError
from memwatch.snapshot.reader import parse_snapshot, to_plain


def main() -> None:
    limits = json.loads(sys.argv[1])
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (int(limits["memory_bytes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        raw = sys.stdin.buffer.read(int(limits["size_bytes"]) + 1)
        answer = {"ok": True, "snapshot": to_plain(parse_snapshot(raw, str(limits["name"])))}
        text = json.dumps(answer)
    except UsageError as exc:
        text = json.dumps({"ok": False, "error": str(exc)})
    except MemoryError:
        os._exit(3)
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
