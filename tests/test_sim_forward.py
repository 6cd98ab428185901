"""The simulator's forward pass, tensor by tensor: its peak, its shortcut over layers, its calibration,
and the simulator's one-way module structure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memwatch.models import ModelSpec, forward_activation_bytes
from memwatch.sim import forward
from memwatch.sim.forward import TensorOp, forward_ops
from memwatch.sim.gpu import VirtualGPU

GiB = 1 << 30


def _peak(ops: list[TensorOp]) -> int:
    live, sizes, peak = 0, {}, 0
    for op in ops:
        if op.nbytes:
            sizes[op.name] = -(-op.nbytes // 512) * 512
            live += sizes[op.name]
            peak = max(peak, live)
        else:
            live -= sizes.pop(op.name)
    assert live == 0 and not sizes  # every tensor is freed by the end
    return peak


@pytest.mark.parametrize(("model", "tokens", "seqs", "prefill", "attention"), [
    ("Qwen3-0.6B", 4096, 1, True, "flash"),
    ("Qwen2.5-7B-Instruct", 16_384, 4, True, "flash"),
    ("Qwen3-0.6B", 2048, 1, True, "eager"),
    ("Llama-3.1-8B-Instruct", 64, 64, False, "eager"),
])
def test_the_peak_of_the_tensors_is_the_planners_estimate(model: str, tokens: int, seqs: int, prefill: bool,
                                                          attention: str) -> None:
    spec = ModelSpec.load(model)
    ops = forward_ops(spec, tokens, seqs, prefill=prefill, attention=attention, max_seq_len=2048)
    assert _peak(ops) == forward_activation_bytes(spec, tokens, seqs, prefill=prefill, attention=attention,
                                                  max_seq_len=2048)


def _run(spec: ModelSpec, ops: list[TensorOp], gpu: VirtualGPU) -> None:
    live = {}
    for op in ops:
        if op.nbytes:
            live[op.name] = gpu.malloc(op.nbytes)
        else:
            gpu.free(live.pop(op.name))


def test_two_layers_leave_the_allocator_as_every_layer_would(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec.load("Qwen3-0.6B")
    shortcut, full = VirtualGPU(8 * GiB), VirtualGPU(8 * GiB)
    for tokens in (512, 4096, 1024, 3000):  # growing and shrinking batches, each leaving its segments
        _run(spec, forward_ops(spec, tokens, 1, prefill=True), shortcut)
        with monkeypatch.context() as patch:
            patch.setattr(forward, "LAYERS_SIMULATED", spec.num_hidden_layers)
            every_layer = forward_ops(spec, tokens, 1, prefill=True)
        assert len(every_layer) > len(forward_ops(spec, tokens, 1, prefill=True))
        _run(spec, every_layer, full)
        assert shortcut.read_step() == full.read_step()
        assert sorted(b.size for b in shortcut._free_blocks) == sorted(b.size for b in full._free_blocks)


def test_calibration_against_vllms_profile_of_llama_3_8b() -> None:
    # vLLM pull request 10511 (December 2024) logs "PyTorch activation peak memory 1.26GiB" for
    # meta-llama/Meta-Llama-3-8B on one GPU, profiling 8,192 batched tokens over 256 sequences.
    # Llama-3.1-8B-Instruct has the same shapes (hidden 4,096, MLP 14,336, 8 KV heads, vocab 128,256).
    spec = ModelSpec.load("Llama-3.1-8B-Instruct")
    estimate = _peak(forward_ops(spec, 8192, 256, prefill=True))
    assert estimate == 8192 * 2 * (3 * 4096 + 3 * 14336) + 256 * 128_256 * 4  # MLP phase + fp32 logits
    assert 0.75 * 1.26 * GiB <= estimate <= 1.26 * GiB  # within 25 %, and never above what was measured


def test_the_simulator_modules_import_one_way() -> None:
    """No cycle among the simulator's modules, counting imports made only for type checking."""
    package = Path(forward.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memwatch.sim."):
                imported.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = imported
    order: list[str] = []
    visiting: set[str] = set()

    def visit(module: str, trail: tuple[str, ...]) -> None:
        assert module not in visiting, f"import cycle: {' -> '.join((*trail, module))}"
        if module in order:
            return
        visiting.add(module)
        for dependency in sorted(graph.get(module, ())):
            visit(dependency, (*trail, module))
        visiting.discard(module)
        order.append(module)

    for module in sorted(graph):
        visit(module, ())
    assert order.index("faults") < order.index("scenario") and order.index("faults") < order.index("runner")
    assert "runner" not in graph["faults"] | graph["fault_kinds"] and "scenario" not in graph["faults"]


def test_forward_ops_rejects_what_the_estimate_rejects() -> None:
    spec = ModelSpec.load("Qwen3-0.6B")
    with pytest.raises(Exception, match="one token per sequence"):
        forward_ops(spec, 10, 5, prefill=False)
