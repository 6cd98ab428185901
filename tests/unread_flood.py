"""Clients that send a whole ``GET /metrics`` and never read the answer, and the listener they are aimed at.

Both are scripts run as processes of their own (``python -c``), as a sidecar's listener and its clients are:

- :data:`SLOW_LISTENER`: memwatch's listener with ``/metrics`` offloaded, a render costing 10 ms and 64 KiB (a
  sidecar storing a few ranks); prints its port, and on end of input the renders made and the requests refused.
  ``python -c SLOW_LISTENER NAME``.
- :data:`UNREAD`: keeps COUNT complete requests open for SECONDS, opening another as each is answered (or cut)
  and closed unread; prints ``ready`` once all are sent, and at the end how many it opened.
  ``python -c UNREAD PORT COUNT SECONDS``.
"""

from __future__ import annotations

import textwrap

SLOW_LISTENER = textwrap.dedent("""
    import sys, time
    from memwatch.export.http_serving import HttpListener, Reply
    BODY = b"# a scrape\\n" * (64 * 1024 // 11)
    renders = [0]
    def render(path):
        renders[0] += 1
        time.sleep(0.01)
        return Reply(200, BODY)
    served = HttpListener("127.0.0.1", 0, render, name=sys.argv[1], option="--" + sys.argv[1], offload=("/metrics",))
    served.start()
    print(served.port, flush=True)
    sys.stdin.read()
    print(renders[0], served.refused, flush=True)
""")
UNREAD = textwrap.dedent("""
    import selectors, socket, sys, time
    port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    selector = selectors.DefaultSelector()
    opened = 0
    def open_one():
        global opened
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")  # complete; the answer is never read
        selector.register(sock, selectors.EVENT_READ)
        opened += 1
    for _ in range(count):
        open_one()
    print("ready", flush=True)
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        for key, _ in selector.select(timeout=0.1):  # answered (or cut): closed unread, and another sent
            selector.unregister(key.fileobj)
            key.fileobj.close()
            open_one()
    print(opened, flush=True)
""")
