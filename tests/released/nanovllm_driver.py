"""Run the released ``nano-vllm-fork`` (installed by ``make engines``) on CPU: its real ``LLM``/``ModelRunner``.

Run as ``python nanovllm_driver.py MODEL_DIR``; prints the generated token ids as one JSON line.
Everything of the engine runs as shipped — config, scheduler, block manager, model runner, Qwen3
model, sampler — but what needs a GPU, each at its narrowest seam:

* CUDA: ``torch.cuda``'s memory API answers from ``fake_cuda``; the default device and
  ``Tensor.cuda()`` stay on the CPU; pinned host memory is plain memory; the process group uses gloo
  instead of NCCL; ``torch.compile`` is off (``TORCHDYNAMO_DISABLE``; on a GPU it would emit Triton).
* flash-attn: ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` in plain PyTorch (causal
  attention over each sequence, reading the paged KV cache through the block table).
* Triton: the ``store_kvcache`` kernel as one indexed copy into the cache.

The tokenizer is an object with the end-of-sequence id (nano-vllm's ``LLM`` accepts one); prompts are
token ids. Sampling draws from torch's generator, seeded, so two runs give the same tokens.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

from fake_device import load_fake_cuda

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _cpu_torch() -> None:
    import torch
    import torch.distributed as dist

    set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: set_default_device("cpu" if "cuda" in str(device) else device)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    for name in ("zeros", "empty", "tensor"):
        factory = getattr(torch, name)

        def unpinned(*args: Any, _factory: Any = factory, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return _factory(*args, **kwargs)

        setattr(torch, name, unpinned)
    init_process_group = dist.init_process_group
    dist.init_process_group = lambda backend, *args, **kwargs: init_process_group("gloo", *args, **kwargs)


def _attention(q: Any, k: Any, v: Any, scale: float, causal_offset: int) -> Any:
    """Causal attention of one sequence: q [n, heads, d] against k, v [m, kv_heads, d]."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=causal_offset)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(dim=-1), v).to(q.dtype)


def _gather(cache: Any, block_table: Any, length: int) -> Any:
    """The first ``length`` tokens of one sequence from a paged cache [blocks, block_size, heads, d]."""
    blocks = cache[block_table[block_table >= 0].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _flash_attn() -> types.ModuleType:
    module = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale,
                               causal=True, block_table=None):
        import torch

        outputs = []
        for i in range(len(cu_seqlens_q) - 1):
            q_i = q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]
            length = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            if block_table is None:
                k_i, v_i = k[cu_seqlens_k[i]:cu_seqlens_k[i + 1]], v[cu_seqlens_k[i]:cu_seqlens_k[i + 1]]
            else:
                k_i, v_i = _gather(k, block_table[i], length), _gather(v, block_table[i], length)
            outputs.append(_attention(q_i, k_i, v_i, softmax_scale, length - q_i.shape[0]))
        return torch.cat(outputs)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal=True):
        import torch

        outputs = []
        for i in range(q.shape[0]):
            length = int(cache_seqlens[i])
            k_i, v_i = _gather(k_cache, block_table[i], length), _gather(v_cache, block_table[i], length)
            outputs.append(_attention(q[i], k_i, v_i, softmax_scale, length - q[i].shape[0]))
        return torch.stack(outputs)

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


def _triton() -> tuple[types.ModuleType, types.ModuleType]:
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    language.constexpr = int
    triton.jit = lambda fn: fn
    triton.language = language
    return triton, language


def _store_kvcache(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any) -> None:
    """What nano-vllm's Triton kernel does: row ``i`` of key/value into cache slot ``slot_mapping[i]``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, key.shape[1] * key.shape[2])[slots] = key[keep].reshape(len(slots), -1)
    v_cache.view(-1, value.shape[1] * value.shape[2])[slots] = value[keep].reshape(len(slots), -1)


def _write_checkpoint(model: str) -> None:
    """A seeded random checkpoint in the layout Hugging Face writes for Qwen3 (what ``load_model`` reads)."""
    import torch
    from safetensors.torch import save_file

    path = Path(model) / "model.safetensors"
    if path.exists():
        return
    config = json.loads((Path(model) / "config.json").read_text())
    hidden, heads, kv_heads, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                         config["num_key_value_heads"], config["head_dim"])
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update({
            layer + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            layer + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            layer + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            layer + "self_attn.q_norm.weight": (head_dim,), layer + "self_attn.k_norm.weight": (head_dim,),
            layer + "mlp.gate_proj.weight": (config["intermediate_size"], hidden),
            layer + "mlp.up_proj.weight": (config["intermediate_size"], hidden),
            layer + "mlp.down_proj.weight": (hidden, config["intermediate_size"]),
            layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
        })
    generator = torch.Generator().manual_seed(1234)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(*shape, generator=generator) * 0.05)
               for name, shape in shapes.items()}
    save_file({name: tensor.to(torch.bfloat16) for name, tensor in tensors.items()}, str(path))


class _Tokenizer:
    eos_token_id = -1  # never sampled: generations end at max_tokens

    @staticmethod
    def decode(token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))


def main() -> None:
    model = sys.argv[1]
    _write_checkpoint(model)
    load_fake_cuda()
    # torch and transformers first, so that they still see no Triton once the stand-in is in place
    import torch._dynamo
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    triton, language = _triton()
    sys.modules.update({"flash_attn": _flash_attn(), "triton": triton, "triton.language": language})
    import nanovllm.layers.attention as attention
    import torch
    from nanovllm import LLM, SamplingParams

    del sys.modules["triton"], sys.modules["triton.language"]  # nano-vllm holds its own reference
    attention.store_kvcache = _store_kvcache
    _cpu_torch()

    llm = LLM(model, tokenizer=_Tokenizer(), enforce_eager=True, tensor_parallel_size=1, max_model_len=512,
              max_num_batched_tokens=512, max_num_seqs=4, gpu_memory_utilization=0.9)
    torch.manual_seed(0)
    prompts = [list(range(1, 301)), list(range(1, 301)) + [5] * 50, [9] * 40]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)

    print(json.dumps([output["token_ids"] for output in outputs]))


if __name__ == "__main__":
    main()
