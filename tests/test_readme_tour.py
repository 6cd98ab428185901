"""The README's tour, walked as a newcomer does: a fresh clone, one shell, every line exactly as printed.

Nothing is assumed that the README does not say: the shell starts without memwatch on its PATH and
without a virtual environment, so ``memwatch`` works only because the tour's own ``source`` line
says how. Each line must succeed (exit 0), unless its comment says ``exit N:``. ``make demo`` must
leave a ``.venv`` without PyTorch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tour_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## A tour\n.*?^```\n(.*?)^```", readme, re.S | re.M)
    assert block, "the README has no tour block"
    return [line for line in block[1].splitlines() if line.strip()]


def expected_status(line: str) -> int:
    comment = line.partition(" #")[2]
    match = re.search(r"\bexit (\d+):", comment)
    return int(match[1]) if match else 0


def _newcomer_env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without any virtual environment, memwatch setting or memwatch on PATH; a private
    store."""
    env = {key: value for key, value in os.environ.items()  # no MEMWATCH_* a test session set (MEMWATCH_SPAWN=0)
           if key not in ("VIRTUAL_ENV", "PYTHONPATH") and not key.startswith(("PYTEST", "MEMWATCH"))}
    venv_bins = {str(Path(sys.prefix) / "bin"), str(ROOT / ".venv" / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p not in venv_bins)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env.update(MEMWATCH_RUNTIME_DIR=str(runtime), MEMWATCH_DB=str(tmp_path / "memwatch.db"))
    return env


def test_the_tour_runs_as_printed_from_a_fresh_clone(tmp_path: Path) -> None:
    lines = tour_lines()
    assert lines[0].startswith("make demo")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    env = _newcomer_env(tmp_path)
    assert subprocess.run(["bash", "-c", "command -v memwatch"], env=env, capture_output=True).returncode != 0

    status = tmp_path / "status"
    script = ["set -m"]  # job control, as in the interactive shell the tour is typed into
    for index, line in enumerate(lines):
        script += [line, f'echo "{index} $?" >> {status}']
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=420)
    output = done.stdout + done.stderr
    statuses = dict(line.split() for line in status.read_text().splitlines())
    for index, line in enumerate(lines):
        assert statuses.get(str(index)) == str(expected_status(line)), (line, output[-4000:])

    # The demo's environment runs memwatch without PyTorch; the leak scenario was stored and explained.
    no_torch = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                               "import importlib.util as u; print(u.find_spec('torch') is None)"],
                              capture_output=True, text=True, timeout=60)
    assert no_torch.stdout.strip() == "True"
    assert "ran out of memory" in done.stdout
    assert "The KV cache holds 88,832 tokens" in done.stdout
    # sim waited until the sidecar stored its run; attach, piped, printed a frame per second, not one.
    assert done.stdout.count("stored by the sidecar") == 2, done.stdout[-6000:]
    assert done.stdout.count("ledger per rank") >= 2 and "source ring" in done.stdout
