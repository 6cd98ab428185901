"""Mirror of vLLM 0.33.0's interfaces that memwatch's vLLM adapter touches, for CPU tests.

Same module paths, class and method names, argument lists and call order as the 0.33.0 wheel; the
bodies are minimal (one in-process worker, a scheduler without chunked prefill or prefix caching)
and run on ``fake_cuda``'s simulated device.
"""
