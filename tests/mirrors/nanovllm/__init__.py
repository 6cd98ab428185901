"""Mirror of nano-vllm's interfaces (GeeeekExplorer/nano-vllm ``bb823b3``) for memwatch's CPU tests.

Same module paths, class and method names, argument lists and call order as upstream; the bodies
are minimal and run on ``fake_cuda``'s simulated device instead of a GPU. Sub-packages have no
``__init__.py``, as upstream.
"""

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
