"""Headless Chromium driven over the DevTools protocol on a pipe (stdlib only), for the report's page.

``open_page`` starts Debian's ``chromium`` with ``--remote-debugging-pipe`` (commands on fd 3, replies
on fd 4, each a JSON message ended by a NUL byte), opens one page, records every network request that
page makes (``Network.requestWillBeSent``: the page's own load and anything it fetches, never the
browser's background traffic), waits until a JavaScript condition holds, and takes a full-page
screenshot. Every wait has a deadline, and the browser is killed at the end whatever happened.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--proxy-server=http://127.0.0.1:9", "--remote-debugging-pipe")
"""Root needs --no-sandbox; the discard-port proxy makes sure nothing leaves the machine even if asked."""


def chromium_path() -> str | None:
    return shutil.which("chromium")


@dataclass
class PageResult:
    requests: list[str] = field(default_factory=list)
    """The URL of every request the page made, its own load included, in order."""
    screenshot: bytes = b""
    value: Any = None
    """What the wait condition evaluated to when it held."""


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int, deadline: float) -> None:
        self._w, self._r, self._deadline = write_fd, read_fd, deadline
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._w, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            message = self._read()
            self.events.append(message)
            if message.get("method") == method:
                return message

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)


def open_page(url: str, condition: str, *, width: int = 1400, timeout: float = 90.0) -> PageResult:
    """Load ``url``, wait until the JavaScript expression ``condition`` is truthy, screenshot the whole page."""
    binary = chromium_path()
    assert binary is not None, "chromium is not installed: `make test` installs it (apt-get install chromium)"
    deadline = time.monotonic() + timeout
    commands_r, commands_w = os.pipe()
    replies_r, replies_w = os.pipe()

    profile = tempfile.mkdtemp(prefix="memwatch-chromium-")
    # The child's ends go above 10, then bash moves them to fds 3 and 4 (no preexec_fn, which is
    # unsafe in a process with threads).
    child_r, child_w = fcntl.fcntl(commands_r, fcntl.F_DUPFD, 10), fcntl.fcntl(replies_w, fcntl.F_DUPFD, 10)
    os.close(commands_r)
    os.close(replies_w)
    wrapper = f'exec "$0" "$@" 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-'
    process = subprocess.Popen(["bash", "-c", wrapper, binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               pass_fds=(child_r, child_w))
    os.close(child_r)
    os.close(child_w)
    try:
        pipe = _Pipe(commands_w, replies_r, deadline)
        target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        pipe.send("Network.enable", {}, session)
        pipe.send("Page.enable", {}, session)
        pipe.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)
        pipe.send("Page.navigate", {"url": url}, session)
        pipe.wait_event("Page.loadEventFired")
        result = PageResult()
        while True:
            evaluated = pipe.send("Runtime.evaluate", {"expression": condition, "returnByValue": True}, session)
            result.value = evaluated.get("result", {}).get("value")
            if result.value:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {condition!r}")
            time.sleep(0.1)
        size = pipe.send("Page.getLayoutMetrics", {}, session)["cssContentSize"]
        pipe.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": int(size["height"]), "deviceScaleFactor": 1, "mobile": False}, session)
        time.sleep(0.3)  # let plotly's responsive layout settle at the new viewport
        shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
        result.screenshot = base64.b64decode(shot["data"])
        result.requests = [event["params"]["request"]["url"] for event in pipe.events
                           if event.get("method") == "Network.requestWillBeSent" and event.get("sessionId") == session]
        try:
            pipe.send("Browser.close")
        except (RuntimeError, TimeoutError):
            pass
        return result
    finally:
        os.close(commands_w)
        os.close(replies_r)
        process.kill()
        process.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)
