"""Mirror of ``vllm/v1/core``."""
