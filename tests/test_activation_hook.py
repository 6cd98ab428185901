"""Zero-code activation: the ``.pth`` line, the MEMWATCH switch, the shared run id, ``memwatch run``.

Child interpreters run the real ``engine/memwatch_autoload.pth`` line at start-up (see
``mirrors/zero_code.py``), exactly as an installed memwatch does from site-packages.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mirrors.zero_code import AUTOLOAD_PTH, zero_code_env

from memwatch_engine.adapters.hooks import Guard, wrap_method

PROBE = """
import json, os, sys
from multiprocessing import get_context

def child(queue):
    queue.put(os.environ.get("MEMWATCH_RUN_ID"))

activated = "memwatch_engine.activate" in sys.modules
hooked = any(type(f).__name__ == "PatchOnImport" for f in sys.meta_path)
if __name__ == "__main__":
    ctx = get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=child, args=(queue,))
    worker.start()
    spawned = queue.get(timeout=60)
    worker.join()
    print(json.dumps([activated, hooked, os.environ.get("MEMWATCH_RUN_ID"), spawned]))
"""


def _probe(tmp_path: Path, env: dict[str, str]) -> tuple[list, str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    base = {key: value for key, value in os.environ.items() if key not in ("MEMWATCH", "MEMWATCH_RUN_ID")}
    env = zero_code_env(base, tmp_path)
    del env["MEMWATCH"]
    env.update(extra)
    return env


def test_pth_is_one_guarded_import_line() -> None:
    lines = AUTOLOAD_PTH.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert 'os.environ.get("MEMWATCH", "0")' in lines[0] and lines[0].endswith(".autoload()")


def test_off_unless_asked(tmp_path: Path) -> None:
    (activated, hooked, run_id, spawned), _ = _probe(tmp_path, _env(tmp_path))
    assert (activated, hooked, run_id, spawned) == (False, False, None, None)


def test_memwatch_1_hooks_this_process_and_spawned_ones_with_one_run_id(tmp_path: Path) -> None:
    (activated, hooked, run_id, spawned), stderr = _probe(tmp_path, _env(tmp_path, MEMWATCH="1"))
    assert activated and hooked
    assert run_id and spawned == run_id
    assert stderr == ""


def test_a_given_run_id_is_kept(tmp_path: Path) -> None:
    (_, _, run_id, spawned), _ = _probe(tmp_path, _env(tmp_path, MEMWATCH="yes", MEMWATCH_RUN_ID="job-42"))
    assert run_id == spawned == "job-42"


@pytest.mark.parametrize(("value", "imported"), [("0", False), ("", False), ("off", True)])
def test_memwatch_0_always_wins(tmp_path: Path, value: str, imported: bool) -> None:
    env = _env(tmp_path, MEMWATCH=value)
    (activated, hooked, run_id, _), _ = _probe(tmp_path, env)
    # "0" and "" stop at the .pth line's own check; other spellings of off are declined by autoload()
    assert (activated, hooked, run_id) == (imported, False, None)
    code = "import memwatch_engine.activate as a; print(a.install())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False"


def test_an_unknown_value_counts_as_off_and_says_so(tmp_path: Path) -> None:
    (activated, hooked, _, _), stderr = _probe(tmp_path, _env(tmp_path, MEMWATCH="maybe"))
    assert activated and not hooked  # the line imports the module, which then declines
    assert "memwatch: MEMWATCH='maybe' is not understood and counts as off" in stderr


class Engine:
    def step(self, value: int) -> int:
        if value < 0:
            raise ValueError("negative")
        return value * 2


def test_a_failing_hook_turns_itself_off_and_the_engine_runs_on(caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard("toy")
    seen: list[int] = []

    def broken(value: int) -> None:
        seen.append(value)
        raise KeyError("no such field")

    def wrap(original):  # type: ignore[no-untyped-def]
        def step(self: Engine, value: int) -> int:
            guard.call(broken, value)
            return original(self, value)

        return step

    class Local(Engine):
        step = Engine.step

    wrap_method(Local, "step", wrap)
    wrap_method(Local, "step", wrap)  # idempotent: still one wrapper
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        assert [Local().step(n) for n in (1, 2, 3)] == [2, 4, 6]
    assert seen == [1] and not guard.active
    assert [r.getMessage() for r in caplog.records] == [
        "memwatch: the toy adapter turned itself off after an internal error (the engine goes on unobserved): "
        "KeyError: 'no such field'"]
    with pytest.raises(ValueError, match="negative"):  # the engine's own errors pass through untouched
        Local().step(-1)
    assert Local.step.__wrapped__ is Engine.step


RUN = "from memwatch.cli import main; from memwatch.cli.run import command; main.add_command(command); main()"


def test_memwatch_run_execs_the_command_with_the_switch_and_one_run_id(tmp_path: Path) -> None:
    show = "import os, sys; print(os.environ['MEMWATCH'], os.environ['MEMWATCH_RUN_ID'], os.environ['MEMWATCH_DB']);" \
           " sys.exit(3)"
    db = tmp_path / "runs.db"
    done = subprocess.run([sys.executable, "-c", RUN, "run", "--db", str(db), "--run-id", "bench-7", "--",
                           sys.executable, "-c", show], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3  # the command's own status: memwatch run replaced itself with it
    assert done.stdout.split() == ["1", "bench-7", str(db)]
    assert done.stderr == "memwatch run: run id bench-7\n"


def test_memwatch_run_explains_bad_input() -> None:
    bad_id = subprocess.run([sys.executable, "-c", RUN, "run", "--run-id", "a/b", "--", "true"],
                            capture_output=True, text=True, timeout=60)
    assert (bad_id.returncode, bad_id.stderr) == (
        2, "error: run id 'a/b' must be 1-16 letters, digits, '.', '_' or '-'\n")
    missing = subprocess.run([sys.executable, "-c", RUN, "run", "--", "no-such-program-here"],
                             capture_output=True, text=True, timeout=60)
    assert (missing.returncode, missing.stderr) == (
        3, "error: command not found: 'no-such-program-here'; check the spelling or give its full path\n")
