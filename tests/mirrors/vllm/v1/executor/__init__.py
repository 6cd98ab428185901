"""Mirror of ``vllm/v1/executor``."""
