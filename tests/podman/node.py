"""One "node" in a temporary directory: the agent's pod (the DaemonSet's template) up, engine pods played beside it."""

from __future__ import annotations

import copy
from pathlib import Path

from .fixtures import Setup, as_uid, engine_spec, manifest, set_env
from .pods import Played, wait_for
from .transforms import Doc, playable


class Node:
    """The agent's documents played on a node directory, and engine pods of ``engine`` (an engine pod's
    documents; default: deploy/daemonset's) played as one pod per uid. Taken down in reverse by ``close``."""

    def __init__(self, built: Setup, root: Path, agent: list[Doc] | None = None,
                 engine: list[Doc] | None = None) -> None:
        self.built, self.root = built, root
        self.engine_docs = engine if engine is not None else manifest("daemonset", "vllm-pod.yaml")
        self.plays: list[Played] = []
        docs, self.ports = playable(agent if agent is not None else manifest("daemonset", "memwatch-agent.yaml"),
                                    built.by_role, root)
        self.agent = self.play(docs, "agent")
        self.rings = root / "var/run/memwatch/rings"
        self.db = root / "var/lib/memwatch/memwatch.db"

    def play(self, docs: list[Doc], name: str) -> Played:
        played = Played(self.built.podman, docs, self.root, name)
        self.plays.append(played)
        return played

    def engines(self, uids: dict[int, str], **env: str) -> Played:
        """Engine pods, one per uid, as one play."""
        wait_for(self.rings.is_dir, 30, "the agent's rings directory")
        docs: list[Doc] = []
        for uid, name in uids.items():
            for doc in copy.deepcopy(self.engine_docs):
                if doc.get("kind") == "Pod":
                    doc = as_uid(doc, uid, name)
                    set_env(engine_spec(doc), **env)
                docs.append(doc)
        played, _ = playable(docs, self.built.by_role, self.root)
        return self.play(played, f"engines-{'-'.join(map(str, uids))}")

    def close(self) -> None:
        for played in reversed(self.plays):
            try:
                played.down()
            except Exception:  # one pod's failure to stop must not leave the others running
                pass
