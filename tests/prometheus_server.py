"""A real Prometheus server for tests (Debian's ``prometheus`` package), on a loopback port, stopped by pid."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

INSTALL_HINT = "install Debian's prometheus package (make test-deps does it as root)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed: {INSTALL_HINT}"
    return path


class PrometheusServer:
    """``prometheus`` scraping ``targets`` every second and evaluating ``rule_files`` every second."""

    def __init__(self, directory: Path, targets: list[str], rule_files: list[Path]) -> None:
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [{"job_name": "memwatch", "static_configs": [{"targets": targets}]}],
        }))
        self.log = open(directory / "prometheus.log", "w")  # noqa: SIM115 (closed by stop())
        self.proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("prometheus did not become ready in 30 s")

    def api(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (a vector's samples), now or at unix time ``at``."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return self.api("query", **params)["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # by its pid: SIGTERM to this very process
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
