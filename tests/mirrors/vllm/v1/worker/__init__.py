"""Mirror of ``vllm/v1/worker``."""
