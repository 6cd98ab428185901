"""Engine adapters: instrument nano-vllm and vLLM without changing their code, and catch OOMs.

Each adapter only wraps engine methods (see :mod:`.hooks`): the engine's own code runs unchanged,
and a fault on memwatch's side turns that adapter off with one warning. One package per engine
(``vllm/``, ``nanovllm/``: its hooks, its readings, its scheduler side, its late-attach side) over a
shared core: :mod:`.hooks` (import hooks and method wrapping), :mod:`.oom` (the OOM observer),
:mod:`.late` (what attaching to a running engine shares) and :mod:`.dispatch` (the list of engines).
Engine packages import the core, never each other nor the dispatch. Activation is
:func:`memwatch_engine.activate.install` (what ``MEMWATCH=1`` does at interpreter start) or, for
vLLM, its ``vllm.general_plugins`` entry point. Plain PyTorch loops call
:class:`memwatch_engine.Monitor` directly and :func:`.oom.capture_oom` for OOM capture.
"""
