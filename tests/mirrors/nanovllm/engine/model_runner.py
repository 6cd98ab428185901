"""Mirror of ``nanovllm/engine/model_runner.py``: the same ``__init__`` order, formula and control plane.

Differences, all for running on CPU: the process group uses gloo, and its port and the shared-memory
name come from ``NANOVLLM_MIRROR_PORT`` (upstream: fixed port 2333 and name "nanovllm") so tests can
run side by side; device memory comes from ``fake_cuda``. A forward takes
``tokens × hidden × dtype size × 4`` bytes of activations, freed when it returns, and does one
all-reduce across the ranks, as the row-parallel layers of the real model do (it keeps the ranks in
step, which the one-slot shared-memory control plane relies on).
"""

import os
import pickle
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import fake_cuda
import torch
import torch.distributed as dist
from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.loader import load_model

PORT = int(os.environ.get("NANOVLLM_MIRROR_PORT", "2333"))
ACTIVATION_FACTOR = 4


class ModelRunner:
    def __init__(self, config: Config, rank: int, event: Event | list[Event]):
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.enforce_eager = config.enforce_eager
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.event = event

        dist.init_process_group("gloo", f"tcp://localhost:{PORT}", world_size=self.world_size, rank=rank)
        torch.cuda.set_device(rank)
        self.model = Qwen3ForCausalLM(hf_config)
        load_model(self.model, config.model)
        self.sampler = Sampler()
        self.warmup_model()
        self.allocate_kv_cache()
        if not self.enforce_eager:
            self.capture_cudagraph()

        if self.world_size > 1:
            if rank == 0:
                self.shm = SharedMemory(name=f"nanovllm-{PORT}", create=True, size=2**20)
                dist.barrier()
            else:
                dist.barrier()
                self.shm = SharedMemory(name=f"nanovllm-{PORT}")
                self.loop()

    def exit(self):
        if self.world_size > 1:
            self.shm.close()
            dist.barrier()
            if self.rank == 0:
                self.shm.unlink()
        if not self.enforce_eager:
            del self.graphs, self.graph_pool
        torch.cuda.synchronize()
        dist.destroy_process_group()

    def loop(self):
        while True:
            method_name, args = self.read_shm()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def read_shm(self):
        assert self.world_size > 1 and self.rank > 0
        self.event.wait()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4:n + 4])
        self.event.clear()
        return method_name, args

    def write_shm(self, method_name, *args):
        assert self.world_size > 1 and self.rank == 0
        data = pickle.dumps([method_name, *args])
        self.shm.buf[0:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:len(data) + 4] = data
        for event in self.event:
            event.set()

    def call(self, method_name, *args):
        if self.world_size > 1 and self.rank == 0:
            self.write_shm(method_name, *args)
        return getattr(self, method_name)(*args)

    def warmup_model(self):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        max_num_batched_tokens, max_model_len = self.config.max_num_batched_tokens, self.config.max_model_len
        seq_len = min(max_num_batched_tokens, max_model_len)
        num_seqs = min(max_num_batched_tokens // seq_len, self.config.max_num_seqs)
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run(seqs, True)
        torch.cuda.empty_cache()

    def allocate_kv_cache(self):
        config = self.config
        hf_config = config.hf_config
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
        current = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        num_kv_heads = hf_config.num_key_value_heads // self.world_size
        head_dim = getattr(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads)
        block_bytes = (2 * hf_config.num_hidden_layers * self.block_size * num_kv_heads * head_dim
                       * hf_config.dtype.itemsize)
        config.num_kvcache_blocks = int(total * config.gpu_memory_utilization - used - peak + current) // block_bytes
        assert config.num_kvcache_blocks > 0
        self.kv_cache = fake_cuda.empty(config.num_kvcache_blocks * block_bytes)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
        hf_config = self.config.hf_config
        activations = fake_cuda.empty(tokens * hf_config.hidden_size * hf_config.dtype.itemsize * ACTIVATION_FACTOR)
        if self.world_size > 1:
            dist.all_reduce(torch.zeros(1))
        temperatures = [seq.temperature for seq in seqs] if self.rank == 0 else None
        token_ids = self.sampler(None, temperatures) if self.rank == 0 else None
        activations.free()
        return token_ids

    def capture_cudagraph(self):
        hf_config = self.config.hf_config
        max_bs = min(self.config.max_num_seqs, 512)
        self.graph_bs = [1, 2, 4, 8, *range(16, max_bs + 1, 16)]
        self.graph_pool = fake_cuda.empty(max_bs * hf_config.hidden_size * hf_config.dtype.itemsize * ACTIVATION_FACTOR)
        self.graphs = dict.fromkeys(self.graph_bs)
