"""Mirror of ``vllm/v1/kv_cache_interface.py``: ``KVCacheTensor``, ``KVCacheGroupSpec``, ``KVCacheConfig``.

As in 0.33.0, every ``KVCacheTensor`` places its layers in one backing allocation of ``size`` bytes,
and each entry carries that whole size.
"""

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
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: str = "full_attention"


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
