"""Mirror of ``nanovllm/models/qwen3.py``: constructing the model allocates its weights on the device.

Bytes per rank (bf16 = 2): ``(2 × vocab × hidden + layers × (4 × hidden² + 3 × hidden × intermediate))
× dtype size // tp`` — embeddings, LM head, attention and MLP projections, sharded over the ranks.
"""

import fake_cuda
import torch.distributed as dist


def weight_bytes(hf_config, tp: int) -> int:
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    params = 2 * hf_config.vocab_size * hidden + hf_config.num_hidden_layers * per_layer
    return params * hf_config.dtype.itemsize // tp


class Qwen3ForCausalLM:
    def __init__(self, config):
        self.config = config
        self.weights = fake_cuda.empty(weight_bytes(config, dist.get_world_size()))
