"""``memwatch runs``' GPU column: one kind of GPU reads one way, whether its name carried its memory or not."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.cli.runs import _gpu, size_label

from stored_runs import store_attached_run

GIB = 1 << 30


@pytest.mark.parametrize(("total", "label"), [
    (16 * GIB, "16GiB"),
    (10 * GIB, "10GiB"),  # the zeros of the decimals go, not those of the number
    (int(22.49 * GIB), "22.49GiB"),
    (int(22.5 * GIB), "22.5GiB"),
    (80 * 10**9, "74.51GiB"),  # an "80GB" card: 80·10⁹ bytes
    (GIB // 2, "0.5GiB"),
])
def test_device_memory_reads_as_a_gpu_name_says_it(total: int, label: str) -> None:
    assert size_label(total) == label


@pytest.mark.parametrize(("name", "total", "shown"), [
    ("NVIDIA L4", 24 * GIB, "NVIDIA L4 24GiB"),
    ("NVIDIA H100 80GB HBM3", 80 * GIB, "NVIDIA H100 80GB HBM3"),  # the name says it already
    ("NVIDIA A100-SXM4-40GB", 40 * GIB, "NVIDIA A100-SXM4-40GB"),
    ("Tesla V100 32 gb", 32 * GIB, "Tesla V100 32 gb"),
    ("H200 141GiB", 141 * GIB, "H200 141GiB"),
    ("MI300X 1.5TB", 192 * GIB, "MI300X 1.5TB"),
    ("NVIDIA GB200", 186 * GIB, "NVIDIA GB200 186GiB"),  # GB in a model name is no size
    ("NVIDIA RTX 4090 24GBX", 24 * GIB, "NVIDIA RTX 4090 24GBX 24GiB"),  # nor is a unit inside a word
    (None, 16 * GIB, "? 16GiB"),
    ("NVIDIA L4", None, "NVIDIA L4"),
    ("NVIDIA L4", 0, "NVIDIA L4"),
    (None, None, ""),
])
def test_the_gpu_column_adds_the_memory_unless_the_name_says_it(name: str | None, total: int | None,
                                                                 shown: str) -> None:
    assert _gpu(name, total) == shown


def test_an_attached_run_is_listed_with_its_gpu_and_memory(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    run_id = store_attached_run(db)
    result = CliRunner().invoke(main, ["--db", str(db), "runs"])
    assert result.exit_code == 0
    [row] = [line for line in result.output.splitlines() if line.startswith(run_id)]
    assert row.endswith(" / NVIDIA L4 24GiB")
