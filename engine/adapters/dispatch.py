"""Which engines memwatch instruments, and in which order it looks for them.

The one module that knows every engine package: zero-code activation (:mod:`memwatch_engine.activate`)
installs all of them as import hooks; an injected memwatch (:mod:`memwatch_engine.inject`) attaches
to the one this process runs. Engine packages never import each other, nor this module.
"""

from __future__ import annotations

import sys

from ..monitor import Monitor
from . import nanovllm, sglang, vllm
from .late import SOURCE


def install() -> None:
    """Patch every known engine when (and if) its modules are imported."""
    nanovllm.install()
    sglang.install()
    vllm.install()


def attach_engines(*, run_id: str, runtime_dir: str | None) -> tuple[str, list[Monitor]] | None:
    """Patch and attach to the engine loaded in this process: (engine name, one monitor per rank), or None."""
    if "sglang" in sys.modules:
        from .sglang import late as sglang_late

        monitors = sglang_late.attach(run_id=run_id, runtime_dir=runtime_dir, source=SOURCE)
        if monitors is not None:
            return "sglang", monitors
    if nanovllm.MODEL_RUNNER in sys.modules:
        from .nanovllm import late as nanovllm_late

        monitors = nanovllm_late.attach(run_id=run_id, runtime_dir=runtime_dir)
        return None if monitors is None else ("nano-vllm", monitors)
    if "vllm" in sys.modules:
        from .vllm import late as vllm_late

        monitors = vllm_late.attach(run_id=run_id, runtime_dir=runtime_dir)
        return None if monitors is None else ("vllm", monitors)
    return None


def detach_engines() -> None:
    """Put every attached engine's own methods back and forget its state (the monitors close apart)."""
    if "sglang" in sys.modules:
        from .sglang import late as sglang_late

        sglang_late.detach()
    if "vllm" in sys.modules:
        from .vllm import late as vllm_late

        vllm_late.detach()
    from .nanovllm import late as nanovllm_late

    nanovllm_late.detach()
