"""The project's images built on the base image: the sidecar (``Dockerfile``), the vLLM stand-in and the engine
image (``deploy/engine.Dockerfile`` on the stand-in), from the working tree, the FROM line set by ``BASE``."""

from __future__ import annotations

from dataclasses import dataclass

from .runtime import CA_BUNDLE, REPO, Podman, timed

SIDECAR = "localhost/memwatch:test"
STANDIN = "localhost/vllm-standin:test"
ENGINE = "localhost/vllm-memwatch:test"


@dataclass(frozen=True)
class Images:
    base: str
    sidecar: str = SIDECAR
    standin: str = STANDIN
    engine: str = ENGINE


def build(podman: Podman, dockerfile: str, tag: str, base: str, context: str = ".") -> None:
    """``podman build`` of one Dockerfile from the repository root; pip reaches its index through the CA bundle."""
    with timed(f"build {tag}"):
        podman.run("build", "--layers", "--network", "host", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro",
                   "--build-arg", f"BASE={base}", "-f", str(REPO / dockerfile), "-t", tag, str(REPO / context),
                   timeout=600)


def build_all(podman: Podman, base: str) -> Images:
    images = Images(base)
    build(podman, "Dockerfile", images.sidecar, base)
    build(podman, "tests/podman/standin/Dockerfile", images.standin, base, context="tests/podman/standin")
    build(podman, "deploy/engine.Dockerfile", images.engine, images.standin)
    return images
