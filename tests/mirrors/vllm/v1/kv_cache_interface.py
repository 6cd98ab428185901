"""Mirror of ``vllm/v1/kv_cache_interface.py``: ``KVCacheTensor`` and ``KVCacheConfig``."""

from dataclasses import dataclass, field


@dataclass
class KVCacheTensor:
    size: int
    layers: list[str]
    layer_stride: int = 0
    block_stride: int = 0
    offset: int = 0
    host_resident: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list = field(default_factory=list)
