"""Mirror of ``nanovllm/layers/sampler.py``: one token per sequence (always 7, never the EOS id)."""


class Sampler:
    def __call__(self, logits, temperatures):
        return [7] * len(temperatures)
