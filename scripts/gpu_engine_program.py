"""The engine program ``gpu_check_engine.py`` runs: a small real PyTorch decoder with a paged KV cache,
written out under nano-vllm's module paths so that memwatch's nano-vllm adapter instruments it.

Kept as text, not as importable modules: it must be written to a scratch directory and imported
there as ``nanovllm``, in a process of its own.
"""

ENGINE_FILES = {
    "nanovllm/__init__.py": "",
    "nanovllm/utils/loader.py": '''
        import torch


        def load_model(model, path):
            """Copy a deterministic "checkpoint" into the parameters the model already allocated."""
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    ''',
    "nanovllm/engine/model_runner.py": '''
        import torch
        import torch.nn.functional as F
        from torch import nn

        from nanovllm.utils.loader import load_model


        class Decoder(nn.Module):
            """A small decoder: grouped-query attention over a paged KV cache, and an MLP."""

            def __init__(self, cfg):
                super().__init__()
                self.cfg = cfg
                h, heads, kv_heads, d = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
                self.embed = nn.Embedding(cfg["vocab"], h)
                self.qkv = nn.ModuleList(nn.Linear(h, (heads + 2 * kv_heads) * d, bias=False)
                                         for _ in range(cfg["layers"]))
                self.out = nn.ModuleList(nn.Linear(heads * d, h, bias=False) for _ in range(cfg["layers"]))
                self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.GELU(),
                                                       nn.Linear(4 * h, h, bias=False))
                                         for _ in range(cfg["layers"]))
                self.head = nn.Linear(h, cfg["vocab"], bias=False)
                self.kv_cache = None

            def forward(self, ids, block_tables, starts, lengths):
                cfg = self.cfg
                heads, kv_heads, d, bs = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
                x = self.embed(ids)
                outputs, offset = [], 0
                for layer in range(cfg["layers"]):
                    qkv = self.qkv[layer](x)
                    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
                    pieces, offset = [], 0
                    for table, start, length in zip(block_tables, starts, lengths):
                        qs = q[offset:offset + length].view(length, heads, d)
                        ks = k[offset:offset + length].view(length, kv_heads, d)
                        vs = v[offset:offset + length].view(length, kv_heads, d)
                        if self.kv_cache is not None and table:
                            pages = torch.tensor(table, device=x.device)
                            positions = torch.arange(start, start + length, device=x.device)
                            blocks, slots = pages[positions // bs], positions % bs
                            self.kv_cache[0, layer, blocks, slots] = ks
                            self.kv_cache[1, layer, blocks, slots] = vs
                            ctx = start + length
                            all_pos = torch.arange(ctx, device=x.device)
                            ks = self.kv_cache[0, layer, pages[all_pos // bs], all_pos % bs]
                            vs = self.kv_cache[1, layer, pages[all_pos // bs], all_pos % bs]
                        groups = heads // kv_heads
                        ks = ks.repeat_interleave(groups, dim=1).transpose(0, 1)
                        vs = vs.repeat_interleave(groups, dim=1).transpose(0, 1)
                        attn = F.scaled_dot_product_attention(qs.transpose(0, 1), ks, vs, is_causal=(start == 0))
                        pieces.append(attn.transpose(0, 1).reshape(length, heads * d))
                        offset += length
                    x = x + self.out[layer](torch.cat(pieces))
                    x = x + self.mlp[layer](x)
                last = torch.tensor([sum(lengths[:i + 1]) - 1 for i in range(len(lengths))], device=x.device)
                return self.head(x[last]).argmax(-1)


        class Sequence:
            """What nano-vllm's runner reads of a sequence: tokens, block table, cached and scheduled counts."""

            def __init__(self, token_ids, block_table=None):
                self.token_ids = token_ids
                self.block_table = block_table or []
                self.num_cached_tokens = 0
                self.num_scheduled_tokens = len(token_ids)


        class ModelRunner:
            """nano-vllm's ModelRunner startup order and KV formula, on one GPU."""

            def __init__(self, config, rank, event):
                self.config = config
                self.block_size = config.kvcache_block_size
                self.world_size = config.tensor_parallel_size
                self.rank = rank
                torch.cuda.set_device(rank)
                torch.set_default_dtype(torch.bfloat16)
                torch.set_default_device("cuda")
                self.model = Decoder(config.model_cfg)
                load_model(self.model, config.model)
                self.warmup_model()
                self.allocate_kv_cache()
                torch.set_default_device("cpu")

            def warmup_model(self):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                seq_len = min(self.config.max_num_batched_tokens, self.config.max_model_len)
                num_seqs = min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs)
                self.run([Sequence(list(range(seq_len))) for _ in range(num_seqs)], True)
                torch.cuda.empty_cache()

            def allocate_kv_cache(self):
                config, cfg = self.config, self.config.model_cfg
                free, total = torch.cuda.mem_get_info()
                used = total - free
                peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"]
                current = torch.cuda.memory_stats()["allocated_bytes.all.current"]
                num_kv_heads = cfg["kv_heads"] // self.world_size
                block_bytes = 2 * cfg["layers"] * self.block_size * num_kv_heads * cfg["head_dim"] * 2
                budget = int(total * config.gpu_memory_utilization - used - peak + current)
                config.num_kvcache_blocks = budget // block_bytes
                assert config.num_kvcache_blocks > 0
                self.kv_cache = torch.empty(2, cfg["layers"], config.num_kvcache_blocks, self.block_size,
                                            num_kv_heads, cfg["head_dim"])
                self.model.kv_cache = self.kv_cache

            def capture_cudagraph(self):
                """Not called: this check runs eagerly (enforce_eager), as its config says."""

            @torch.inference_mode()
            def run(self, seqs, is_prefill):
                starts = [seq.num_cached_tokens for seq in seqs]
                lengths = [seq.num_scheduled_tokens for seq in seqs]
                ids = [t for seq, start, n in zip(seqs, starts, lengths) for t in seq.token_ids[start:start + n]]
                tables = [seq.block_table for seq in seqs]
                out = self.model(torch.tensor(ids, device="cuda"), tables, starts, lengths)
                return out.tolist()

            def exit(self):
                torch.cuda.synchronize()
    ''',
}

ENGINE_MAIN = '''
    import json, os, sys
    import memwatch_engine.activate as activate
    activate.install()

    import torch
    from nanovllm.engine.model_runner import ModelRunner, Sequence


    class Config:
        model = "synthetic"
        max_num_batched_tokens = 8192
        max_num_seqs = 8
        max_model_len = 4096
        gpu_memory_utilization = 0.5
        tensor_parallel_size = 1
        enforce_eager = True
        kvcache_block_size = 256
        num_kvcache_blocks = -1
        model_cfg = {"vocab": 32000, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "layers": 8,
                     "block_size": 256}
        hf_config = None


    class HfConfig:
        num_key_value_heads = 4
        head_dim = 64
        num_hidden_layers = 8
        hidden_size = 1024
        num_attention_heads = 16
        dtype = torch.bfloat16


    config = Config()
    config.hf_config = HfConfig()
    runner = ModelRunner(config, 0, None)
    bs = config.kvcache_block_size
    free_blocks = list(range(config.num_kvcache_blocks))
    seqs = []
    for i in range(4):
        tokens = list(range(1000 + 500 * i))
        seqs.append(Sequence(tokens, [free_blocks.pop() for _ in range(-(-(len(tokens) + 64) // bs))]))
    for token, seq in zip(runner.run(seqs, True), seqs):
        seq.num_cached_tokens = len(seq.token_ids)
        seq.token_ids.append(token)
    for _ in range(32):
        for seq in seqs:
            seq.num_scheduled_tokens = 1
        for token, seq in zip(runner.run(seqs, False), seqs):
            seq.num_cached_tokens = len(seq.token_ids)
            seq.token_ids.append(token)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    report = {"pid": os.getpid(), "free_bytes": free, "total_bytes": total,
              "reserved_bytes": torch.cuda.memory_reserved(), "allocated_bytes": torch.cuda.memory_allocated()}
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        mine = [p for p in listed if p.pid == os.getpid()]
        if not mine and len(listed) == 1:  # a container: NVML speaks host pids; the one process is us
            mine = listed
            report["nvml_error"] = f"NVML lists host pid {listed[0].pid}, taken as this process"
        if mine:
            report["nvml_process_bytes"] = sum(p.usedGpuMemory or 0 for p in mine)
        else:
            report["nvml_error"] = f"pid {os.getpid()} not among NVML's {[p.pid for p in listed]}"
    except Exception as exc:
        report["nvml_error"] = f"{type(exc).__name__}: {exc}"
    report["oom_request_bytes"] = free + (1 << 30)
    print("REPORT " + json.dumps(report), flush=True)
    torch.empty(report["oom_request_bytes"], dtype=torch.uint8, device="cuda")
'''
