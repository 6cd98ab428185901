"""Mirror of ``vllm/v1/metrics``."""
