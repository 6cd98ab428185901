"""The simulated device both released-engine drivers run on: ``tests/mirrors/fake_cuda.py``, loaded alone.

The drivers cannot put ``tests/mirrors`` on the path (its ``vllm`` and ``nanovllm`` stand-ins would
shadow the released packages), so the one module is loaded from its file.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

FAKE_CUDA = Path(__file__).resolve().parent.parent / "mirrors" / "fake_cuda.py"


def load_fake_cuda() -> None:
    """Import ``fake_cuda`` (which installs itself under ``torch.cuda``'s memory API)."""
    spec = importlib.util.spec_from_file_location("fake_cuda", FAKE_CUDA)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_cuda"] = module
    spec.loader.exec_module(module)
