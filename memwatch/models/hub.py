"""Hugging Face repo ids (``org/name``, optionally ``@revision``) resolved to their ``config.json``.

Resolution goes through the ``huggingface_hub`` library, so the cache layout, ``HF_HOME``,
``HF_HUB_CACHE``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` mean what they mean to every other tool: a
config already in the local cache is read from there without touching the network; otherwise,
unless offline, only ``config.json`` is downloaded (into the same cache). The library is imported
only when a hub name has to be looked up, with its telemetry off unless the user set
``HF_HUB_DISABLE_TELEMETRY`` (otherwise it would fetch a registry of its own from the Hub).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from memwatch.errors import NotFoundError, UnavailableError

_TRUE = {"1", "on", "yes", "true"}
CONNECT_TIMEOUT_S = 5.0


def _import_hub() -> None:
    """Import huggingface_hub, which reads its settings from the environment once, at import."""
    if "huggingface_hub" not in sys.modules:
        os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import huggingface_hub  # noqa: F401


@dataclass(frozen=True)
class HubName:
    """A repo id and an optional revision (branch, tag or commit)."""

    repo_id: str
    revision: str | None

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse(name: str) -> HubName | None:
    """The repo id and revision in ``name``, or None when it cannot be a Hugging Face repo id."""
    repo_id, _, revision = name.strip().partition("@")
    if not repo_id or repo_id.endswith(".json") or repo_id.startswith((".", "/", "~")):
        return None
    _import_hub()
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubName(repo_id, revision or None)


def cache_dir() -> Path:
    """The hub cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or Transformers' ``TRANSFORMERS_OFFLINE``) forbids downloads."""
    return any(os.environ.get(key, "").strip().lower() in _TRUE for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cached_config(name: HubName) -> Path | None:
    """The cached ``config.json`` of ``name``, without any network access; None when not cached."""
    _import_hub()
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name.repo_id, "config.json", cache_dir=cache_dir(), revision=name.revision)
    return Path(found) if isinstance(found, str) else None


def _unreachable(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be connected to within a few seconds, or None when it can.

    huggingface_hub retries a failed request for about half a minute; a machine without network
    should hear so at once.
    """
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def download_config(name: HubName) -> Path:
    """Download only ``config.json`` of ``name`` into the cache and return its path."""
    _import_hub()
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = endpoint or "the Hugging Face Hub"
    unreachable = _unreachable(endpoint or "https://huggingface.co")
    if unreachable:
        raise UnavailableError(f"cannot download the config of {name.label!r}: {where} cannot be reached "
                               f"({unreachable}) and it is not in the cache {cache_dir()}; pass a config.json "
                               "path, or set HF_HUB_OFFLINE=1 to look only in the cache")
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.set_verbosity_error()                                  # one line of our own, not its retries
    try:
        return Path(hf_hub_download(name.repo_id, "config.json", revision=name.revision, cache_dir=cache_dir(),
                                    endpoint=endpoint, etag_timeout=10))
    except LocalEntryNotFoundError:
        raise UnavailableError(f"cannot download the config of {name.label!r}: {where} cannot be reached and "
                               f"it is not in the cache {cache_dir()}; pass a config.json path, or set "
                               "HF_HUB_OFFLINE=1 to look only in the cache") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise NotFoundError(f"model {name.label!r} not found on {where} ({type(exc).__name__}); "
                            "check the name and revision, or log in for a gated model") from None
    except Exception as exc:
        raise UnavailableError(f"cannot download the config of {name.label!r} from {where}: {exc}; "
                               "pass a config.json path instead") from None
