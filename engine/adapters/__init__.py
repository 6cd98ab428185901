"""Engine adapters: instrument nano-vllm and vLLM without changing their code, and catch OOMs.

Each adapter only wraps engine methods (see :mod:`.hooks`): the engine's own code runs unchanged,
and a fault on memwatch's side turns that adapter off with one warning. Activation is
:func:`memwatch_engine.activate.install` (what ``MEMWATCH=1`` does at interpreter start) or, for
vLLM, its ``vllm.general_plugins`` entry point. Plain PyTorch loops call
:class:`memwatch_engine.Monitor` directly and :func:`.oom.capture_oom` for OOM capture.
"""
