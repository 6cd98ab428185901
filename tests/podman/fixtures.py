"""What every podman test needs once per test run: the base image and the three images, or why not."""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from .images import Images, build_all
from .runtime import REPO, Podman, cache_dir, containers_refused, ensure_base, timed, timings
from .transforms import Doc, containers, load, pod_spec, role

# Another tree's manifests (e.g. an older commit's, to see a test fail on them): MEMWATCH_DEPLOY_DIR.
DEPLOY = Path(os.environ.get("MEMWATCH_DEPLOY_DIR", REPO / "deploy"))


@dataclass(frozen=True)
class Setup:
    podman: Podman
    images: Images

    @property
    def by_role(self) -> dict[str, str]:
        return {"memwatch": self.images.sidecar, "engine": self.images.engine}


@functools.cache
def setup() -> Setup | str:
    """The images built once per process; a string says why containers cannot run here (a skip)."""
    podman = Podman(cache_dir())
    with podman.locked():
        base = ensure_base(podman)
        refused = containers_refused(podman, base)
        if refused:
            return refused
        with timed("builds"):
            images = build_all(podman, base)
        podman.run("image", "prune", "-f", timeout=120)  # superseded layers: the cache stays bounded
    return Setup(podman, images)


def write_timings() -> None:
    """The phases' seconds of this test run, for the job's measurements."""
    (cache_dir() / "timings.json").write_text(json.dumps(timings, indent=1))


def manifest(*relative: str) -> list[Doc]:
    return load(DEPLOY.joinpath(*relative))


def engine_spec(doc: Doc) -> Doc:
    return next(c for c in containers(doc) if role(c) == "engine")


def set_env(container: Doc, **values: str) -> None:
    """The stand-in's own settings (steps, waiting) beside the manifest's env, which stays as written."""
    env = [e for e in container.setdefault("env", []) if e["name"] not in values]
    container["env"] = env + [{"name": k, "value": v} for k, v in values.items()]


def as_uid(doc: Doc, uid: int, name: str) -> Doc:
    """The same engine pod run as another uid (and primary group), under another name."""
    doc["metadata"]["name"] = name
    context = pod_spec(doc).setdefault("securityContext", {})
    context["runAsUser"] = context["runAsGroup"] = uid
    return doc


def query(db: Path, sql: str, args: tuple = ()) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        try:
            return conn.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # the schema not made yet
            return []
