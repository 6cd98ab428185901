"""Mirror of ``vllm/v1/engine``."""
