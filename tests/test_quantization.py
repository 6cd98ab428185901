"""Quantized weights: each scheme's stored tensors, against published checkpoint sizes and hand-built indexes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli.plan import plan
from memwatch.errors import UsageError
from memwatch.models import ModelSpec
from memwatch.models.quantization import Quantization, from_config, from_option

CONFIGS = Path(__file__).parents[1] / "memwatch/models/configs"
LLAMA = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.json").read_text())
H, INTER, LAYERS, VOCAB = 4096, 14336, 32, 128256
# (in_features, out_features) of every linear layer of one Llama-3.1-8B layer
LINEARS = {"q_proj": (H, H), "k_proj": (H, 1024), "v_proj": (H, 1024), "o_proj": (H, H),
           "gate_proj": (H, INTER), "up_proj": (H, INTER), "down_proj": (INTER, H)}
# fp16 tensors every checkpoint keeps: embeddings, LM head, two norms per layer and the final norm
UNQUANTIZED = 2 * VOCAB * H * 2 + (2 * LAYERS + 1) * H * 2
# The published checkpoints' files (huggingface.co, "Files and versions"):
# hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4: 4.68 GB + 1.05 GB
# hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4: 4.97 GB + 764 MB
PUBLISHED_AWQ = 4.68e9 + 1.05e9
PUBLISHED_GPTQ = 4.97e9 + 0.764e9
# neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8 (compressed-tensors, per-tensor, static input scales): 5 GB + 4.08 GB
PUBLISHED_FP8 = 5e9 + 4.08e9


def quantized_llama(quantization_config: dict[str, object]) -> ModelSpec:
    return ModelSpec.from_config({**LLAMA, "torch_dtype": "float16", "quantization_config": quantization_config},
                                 "Llama-3.1-8B-Instruct-4bit")


def index_total(tensors: dict[str, tuple[tuple[int, ...], int]]) -> int:
    """``total_size`` of a safetensors index: Σ elements × itemsize of each stored tensor."""
    return sum(math.prod(shape) * itemsize for shape, itemsize in tensors.values())


def test_awq_llama_matches_the_published_checkpoint() -> None:
    spec = quantized_llama({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                            "version": "gemm"})
    tensors = {}
    for layer in range(LAYERS):                                        # AutoAWQ WQLinear_GEMM tensors
        for name, (fan_in, fan_out) in LINEARS.items():
            tensors[f"{layer}.{name}.qweight"] = ((fan_in, fan_out // 8), 4)
            tensors[f"{layer}.{name}.qzeros"] = ((fan_in // 128, fan_out // 8), 4)
            tensors[f"{layer}.{name}.scales"] = ((fan_in // 128, fan_out), 2)
    expected = index_total(tensors) + UNQUANTIZED
    assert spec.weight_bytes() == expected == 5_727_854_592
    assert abs(spec.weight_bytes() / PUBLISHED_AWQ - 1) < 0.03
    assert spec.quantization.describe() == "awq 4-bit, group 128 (quantization_config: awq)"


def test_gptq_llama_matches_the_published_checkpoint() -> None:
    spec = quantized_llama({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True})
    tensors = {}
    for layer in range(LAYERS):                                        # AutoGPTQ QuantLinear tensors
        for name, (fan_in, fan_out) in LINEARS.items():
            tensors[f"{layer}.{name}.qweight"] = ((fan_in // 8, fan_out), 4)
            tensors[f"{layer}.{name}.qzeros"] = ((fan_in // 128, fan_out // 8), 4)
            tensors[f"{layer}.{name}.scales"] = ((fan_in // 128, fan_out), 2)
            tensors[f"{layer}.{name}.g_idx"] = ((fan_in,), 4)
    assert spec.weight_bytes() == index_total(tensors) + UNQUANTIZED
    assert abs(spec.weight_bytes() / PUBLISHED_GPTQ - 1) < 0.03


def test_the_issue_example_awq_frees_ten_gigabytes_for_kv() -> None:
    sixteen_bit = ModelSpec.load("Llama-3.1-8B-Instruct").weight_bytes()
    awq = quantized_llama({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True})
    assert sixteen_bit == 8_030_261_248 * 2                            # 14.96 GiB
    assert 9.5e9 < sixteen_bit - awq.weight_bytes() < 10.5e9


def test_bitsandbytes_4bit_and_8bit_per_linear_layer() -> None:
    n = H * H
    plain = Quantization("bnb-4bit", 4)
    double = from_config({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                  "bnb_4bit_use_double_quant": True}})
    # packed nibbles, one fp32 absmax per 64 weights, 16-entry fp32 code book (quant_map); double quant: uint8
    # absmax, nested_absmax fp32 per 256 blocks and the 256-entry fp32 nested_quant_map
    assert plain.linear_bytes(H, H) == n // 2 + 4 * (n // 64) + 4 * 16
    assert double.linear_bytes(H, H) == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4 * 256 + 4 * 16
    eight = from_config({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})
    assert eight.linear_bytes(1024, H) == 1024 * H + 4 * 1024          # int8 and one fp32 SCB per row


def test_fp8_scales_per_tensor_channel_and_block() -> None:
    per_tensor = from_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    assert per_tensor.linear_bytes(H, INTER) == H * INTER + 4
    block = from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert block.linear_bytes(7168, 18432) == 7168 * 18432 + 4 * (7168 // 128) * (18432 // 128)
    channel = from_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                      "targets": ["Linear"]}}, "ignore": ["lm_head"]}})
    assert channel.linear_bytes(1024, H) == 1024 * H + 4 * 1024


def test_compressed_tensors_fp8_llama_matches_the_published_checkpoint() -> None:
    spec = ModelSpec.from_config({**LLAMA, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                  "dynamic": False, "symmetric": True},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                            "dynamic": False, "symmetric": True}}}}})
    tensors = {}
    for layer in range(LAYERS):                                        # weight, weight_scale, input_scale
        for name, (fan_in, fan_out) in LINEARS.items():
            tensors[f"{layer}.{name}.weight"] = ((fan_out, fan_in), 1)
            tensors[f"{layer}.{name}.weight_scale"] = ((1,), 4)
            tensors[f"{layer}.{name}.input_scale"] = ((1,), 4)
    assert spec.weight_bytes() == index_total(tensors) + UNQUANTIZED    # bf16 rest: the same bytes as fp16
    assert abs(spec.weight_bytes() / PUBLISHED_FP8 - 1) < 0.03
    dynamic = from_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    static = from_config({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert static.linear_bytes(H, H) - dynamic.linear_bytes(H, H) == 4


def test_compressed_tensors_w4a16_groups() -> None:
    scheme = from_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                  "group_size": 128, "symmetric": True}}}}})
    # weight_packed int32 [out, in / 8], weight_scale bf16 [out, in / 128]; symmetric: no zero points
    assert scheme.linear_bytes(INTER, H) == INTER * H // 2 + INTER * (H // 128) * 2


def test_norms_embeddings_and_routers_stay_at_the_model_precision() -> None:
    awq = quantized_llama({"quant_method": "awq", "bits": 4, "group_size": 128})
    linear = sum(awq.quantization.linear_bytes(out, fan_in) for fan_in, out in LINEARS.values()) * LAYERS
    assert awq.weight_bytes() - linear == UNQUANTIZED


def test_dtype_and_quantization_options_override_the_config() -> None:
    spec = ModelSpec.load("Llama-3.1-8B-Instruct")
    assert spec.weight_bytes("float16", quantization=from_option("awq")) == 5_727_854_592
    assert spec.weight_bytes("float32") == 8_030_261_248 * 4
    with pytest.raises(UsageError, match="unknown quantization 'int3'"):
        from_option("int3")
    with pytest.raises(UsageError, match="unsupported quant_method 'hqq'"):
        from_config({"quantization_config": {"quant_method": "hqq"}})


def test_plan_shows_the_weight_bytes_and_where_they_come_from(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA, "torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}))
    result = CliRunner().invoke(plan, ["--model", str(config), "--gpu-memory", "24GiB", "--non-torch-bytes", "0"])
    assert result.exit_code == 0
    assert "5,727,854,592 B" in result.stdout
    assert ("8,030,261,248 parameters; linear layers awq 4-bit, group 128 (quantization_config: awq), the rest "
            "float16") in " ".join(result.stdout.split())
    result = CliRunner().invoke(plan, ["--model", str(config), "--gpu-memory", "24GiB", "--quantization", "none",
                                       "--json"])
    data = json.loads(result.stdout)
    assert data["weights_bytes"] == 8_030_261_248 * 2 and data["weights_source"] == "8,030,261,248 parameters × float16"
