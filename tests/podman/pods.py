"""Pods started with ``podman kube play`` from (transformed) manifests, and what an operator looks at in them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .runtime import Podman, timed
from .transforms import Doc, containers, pod_spec, role

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, pause: float = 0.2) -> T:
    """``check()``'s first truthy value within ``timeout`` seconds, else an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(pause)


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
    """(status, body) of ``GET http://127.0.0.1:port/path``; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as exc:
        return 0, str(exc)


class Played:
    """The pods of one ``kube play``: find containers by role, inspect, exec, kill, take down."""

    def __init__(self, podman: Podman, docs: list[Doc], workdir: Path, name: str) -> None:
        self.podman = podman
        self.docs = docs
        self.file = workdir / f"{name}.yaml"
        self.file.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        with timed(f"kube play {name}"):
            podman.run("kube", "play", str(self.file), timeout=180)
        self.up = True

    def container_ids(self, wanted: str) -> list[str]:
        """Ids of this play's containers whose image has role ``wanted`` (in document order)."""
        found = []
        rows = json.loads(self.podman.run("ps", "-a", "--format", "json", timeout=30).stdout or "[]")
        for doc in self.docs:
            pod = doc["metadata"]["name"]
            for spec in containers(doc):
                if role(spec) != wanted:
                    continue
                name = f"{pod}-{spec['name']}"
                found += [r["Id"] for r in rows if any(n in (name, f"{pod}-pod-0-{spec['name']}")
                                                       for n in r.get("Names", []))]
        return found

    def one(self, wanted: str) -> str:
        ids = self.container_ids(wanted)
        assert len(ids) == 1, f"{len(ids)} {wanted} containers in {self.file.name}"
        return ids[0]

    def inspect(self, container: str) -> dict[str, Any]:
        return json.loads(self.podman.run("inspect", container, timeout=30).stdout)[0]

    def state(self, container: str) -> tuple[str, int, int]:
        """(status, exit code, restart count) as ``podman inspect`` shows them."""
        info = self.inspect(container)
        return info["State"]["Status"], info["State"]["ExitCode"], info.get("RestartCount", 0)

    def logs(self, container: str) -> str:
        done = self.podman.run("logs", container, timeout=30)
        return done.stdout + done.stderr

    def exec(self, container: str, *argv: str, timeout: float = 60, check: bool = True) -> str:
        return self.podman.run("exec", container, *argv, timeout=timeout, check=check).stdout

    def healthcheck(self, container: str) -> int:
        """Runs the container's liveness probe once (podman's health check timers need systemd)."""
        return self.podman.run("healthcheck", "run", container, check=False, timeout=60).returncode

    def pod_names(self) -> list[str]:
        """podman's names of this play's pods (a Deployment's first replica is ``NAME-pod-0``)."""
        return [doc["metadata"]["name"] + ("-pod-0" if doc["kind"] == "Deployment" else "") for doc in self.docs]

    def down(self) -> float:
        """Stopped as the kubelet deletes a pod (SIGTERM to every container, the grace period, then SIGKILL),
        then ``kube down``; the seconds it took. (``kube down`` alone ended engines without their exit path.)"""
        if not self.up:
            return 0.0
        start = time.monotonic()
        for doc, pod in zip(self.docs, self.pod_names(), strict=True):
            grace = min(int(pod_spec(doc).get("terminationGracePeriodSeconds", 30)), 60)
            self.podman.run("pod", "stop", "--time", str(grace), pod, timeout=grace + 30, check=False)
        self.podman.run("kube", "down", str(self.file), timeout=120)
        self.up = False
        return time.monotonic() - start
