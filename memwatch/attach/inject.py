"""``memwatch attach --inject PID``: turn on per-step recording inside a running Python engine.

What runs in the target is a few lines (:func:`payload`): they load ``memwatch_engine`` from where
this memwatch is installed when the target's environment lacks it, then call
``memwatch_engine.inject.handle`` with a JSON request, inside a ``try`` that swallows everything.
The lines get there one of two ways:

* Python 3.14+: ``sys.remote_exec`` (PEP 768), called from memwatch's own interpreter when it is the
  same version, else from the target's interpreter binary run as the target's user (never as
  root for another user's file); the target runs the script at its next safe point, without being
  stopped;
* older Pythons: ``gdb`` in batch mode attaches, calls ``PyGILState_Ensure``, ``PyRun_SimpleString``
  and ``PyGILState_Release`` in the main thread, and detaches. The target is stopped for that time
  (about a second, mostly gdb reading symbols). With ``unwindonsignal`` set, a call that does not
  return within the timeout is interrupted and unwound, so the target goes on as it was.

The injected code answers through a private status file in the runtime directory. gdb reads no
init file, auto-loads nothing (a ``-gdb.py`` beside a library is code of the target's side) and
asks no debuginfod server; every program starts as :func:`.programs.as_target` says.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import memwatch_engine
from memwatch_engine.monitor import new_run_id
from memwatch_engine.ring import RingFormatError
from memwatch_engine.ring_reader import RingReader
from memwatch_engine.runtime import ensure_runtime_dir

from ..errors import MemwatchError, NotFoundError, UnavailableError, UsageError
from .inject_checks import Target, check_all
from .programs import (
    TrustedFile,
    UntrustedError,
    as_target,
    open_interpreter,
    open_tool,
    own_interpreter,
    process_ids,
    start,
)
from .ring_source import find_rings

DEFAULT_TIMEOUT_S = 20.0
ENGINE_DIR = Path(memwatch_engine.__file__).resolve().parent


@dataclass
class Injected:
    """What an injection did: the engine it found (``python`` for the sampler), the run, the ranks' pids."""

    pid: int
    run_id: str | None
    engine: str | None
    pids: list[int] = field(default_factory=list)
    rings: list[str] = field(default_factory=list)
    already: bool = False
    warnings: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)


def payload(request: dict[str, Any], engine_dir: Path = ENGINE_DIR) -> str:
    """The one line the target runs: only single quotes, no backslashes, no names left in ``__main__``."""
    status = request.get("status")
    body = f"""
try:
    import importlib.util, sys
    if 'memwatch_engine' not in sys.modules and importlib.util.find_spec('memwatch_engine') is None:
        spec = importlib.util.spec_from_file_location(
            'memwatch_engine', {str(engine_dir / '__init__.py')!r}, submodule_search_locations=[{str(engine_dir)!r}])
        module = importlib.util.module_from_spec(spec)
        sys.modules['memwatch_engine'] = module
        spec.loader.exec_module(module)
    import memwatch_engine.inject
    memwatch_engine.inject.handle({json.dumps(request)!r})
except BaseException as exc:
    try:
        with open({status!r}, 'w') as f:
            f.write(__import__('json').dumps({{'ok': False, 'error': type(exc).__name__ + ': ' + str(exc)}}))
    except BaseException:
        pass
"""
    encoded = base64.b64encode(body.encode()).decode()
    return f"exec(__import__('base64').b64decode('{encoded}').decode(), {{'__name__': '__memwatch__'}})"


def inject(pid: int, *, interval_s: float = 1.0, timeout_s: float = DEFAULT_TIMEOUT_S,
           runtime_dir: Path | None = None) -> Injected:
    """Start recording in ``pid`` and, when it runs an engine, in each of its ranks' processes."""
    directory = ensure_runtime_dir(runtime_dir)
    target, gdb = check_all(pid)
    if _recording({pid}, directory):
        return Injected(pid=pid, run_id=None, engine=None, already=True)
    run_id = new_run_id()
    request = {"action": "start", "run_id": run_id, "runtime_dir": str(directory), "interval_s": interval_s}
    outcome = run_in(target, gdb, {**request, "mode": "auto"}, directory, timeout_s)
    result = Injected(pid=pid, run_id=run_id, engine=outcome.get("engine"), pids=[pid],
                      rings=list(outcome.get("rings", [])), warnings=list(outcome.get("warnings", [])),
                      probes=list(outcome.get("probes", [])))
    if result.engine not in (None, "python"):
        for child in _python_children(pid):
            try:
                child_target, child_gdb = check_all(child)
            except MemwatchError:
                continue  # not a Python process (a compiler, a shell): no rank there
            try:
                answer = run_in(child_target, child_gdb, {**request, "mode": "engine"}, directory, timeout_s)
            except MemwatchError as exc:
                result.warnings.append(f"child process {child} is not recorded: {exc}")
                continue
            if answer.get("rings"):
                result.pids.append(child)
                result.rings.extend(answer["rings"])
                result.warnings.extend(answer.get("warnings", []))
    return result


def detach(pid: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, runtime_dir: Path | None = None) -> list[int]:
    """Undo an injection in ``pid`` and its ranks' processes; the pids that detached."""
    from .hostinfo import HostWatcher

    directory = ensure_runtime_dir(runtime_dir)
    writers = _recording({pid, *HostWatcher(pid).children()}, directory)
    if not writers:
        raise NotFoundError(f"process {pid} is not being recorded by memwatch (no ring); nothing to detach")
    detached = []
    for writer in writers:
        target, gdb = check_all(writer)
        if run_in(target, gdb, {"action": "detach"}, directory, timeout_s).get("detached"):
            detached.append(writer)
    if not detached:
        raise UsageError(f"process {pid} was started with memwatch on, not injected; stop it with the "
                         "engine, or restart it without MEMWATCH=1")
    return detached


def _recording(pids: set[int], directory: Path) -> list[int]:
    """The pids among ``pids`` that write a ring still open (a closed one is only waiting to be drained)."""
    writers: list[int] = []
    for path in find_rings(pids, directory):
        try:
            reader = RingReader(path)
        except (RingFormatError, OSError):
            continue
        if not reader.closed and reader.header.writer_pid not in writers:
            writers.append(reader.header.writer_pid)
        reader.close()
    return sorted(writers)


def run_in(target: Target, gdb: str | None, request: dict[str, Any], directory: Path,
           timeout_s: float) -> dict[str, Any]:
    """Run the payload with ``request`` in the target and return what it reported."""
    status = directory / f"inject-{target.pid}.json"
    status.unlink(missing_ok=True)
    script = directory / f"inject-{target.pid}.{'gdb' if gdb else 'py'}"
    # sys.remote_exec runs the file whenever the target next reaches a safe point, perhaps after we gave up:
    # the lines then remove the file and do nothing.
    request = {**request, "status": str(status), "expires": time.time() + timeout_s,
               "script": None if gdb else str(script)}
    code = payload(request)
    deadline = time.monotonic() + timeout_s
    try:
        if gdb is not None:
            _write_private(script, gdb_commands(code))
            _through_gdb(gdb, target.pid, script, timeout_s)
        else:
            _write_private(script, code + "\n")
            _through_remote_exec(target, script, timeout_s)
        while not status.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        outcome = json.loads(status.read_text())
    except (OSError, ValueError):
        raise UnavailableError(f"process {target.pid} did not report back within {timeout_s:g}s after the "
                               "injection; retry, or raise --inject-timeout") from None
    finally:
        status.unlink(missing_ok=True)
        if gdb is not None:
            script.unlink(missing_ok=True)
    if not outcome.get("ok"):
        raise UnavailableError(f"memwatch could not start inside process {target.pid}: {outcome.get('error')}; "
                               "the process runs on unobserved")
    return outcome


def gdb_commands(code: str) -> str:
    """The gdb script: wait for a safe point, take the GIL, run the line, give the GIL back, detach.

    The safe point is the entry of ``PyEval_SaveThread``: a thread about to release the interpreter
    lock (before a sleep, a read, a lock wait, a CUDA call) holds it in a consistent state, never in
    the middle of the garbage collector or an allocation. Only the symbols of libc and libpython are
    read, which keeps the pause near a second even in a process that loaded PyTorch. When the wait is
    interrupted (the timeout), ``$pc`` is elsewhere and the script only detaches.
    """
    return "\n".join((
        "set confirm off",
        "set pagination off",
        "set unwindonsignal on",
        "sharedlibrary libpython",
        "sharedlibrary libc\\.so",
        "break *PyEval_SaveThread",
        "continue",
        "delete",
        "if $pc == (long) &PyEval_SaveThread",
        "  set $memwatch_gil = (int) PyGILState_Ensure()",
        f'  call (int) PyRun_SimpleString("{code}")',
        "  call (void) PyGILState_Release($memwatch_gil)",
        "end",
        "detach",
        "",
    ))


XSTATE_REFUSED = "Couldn't write extended state status"
"""gdb's words when ``PTRACE_SETREGSET`` of the XSAVE area fails: gdb 13 writes a buffer sized for CPUs before
AMX, which the kernel refuses whole, so no function can be called in the process (it is left as it was)."""

GDB_FLAGS = ("-batch", "-nx", "-q", "-iex", "set auto-load off", "-iex", "set debuginfod enabled off",
             "-iex", "set auto-solib-add off")
"""No init file, nothing auto-loaded from the target's libraries, no symbol server, symbols read on demand."""


def _through_gdb(gdb: str, pid: int, script: Path, timeout_s: float) -> None:
    with open_tool(gdb) as program:  # judged again and run from this descriptor: no path is looked up twice
        proc = start(program, [*GDB_FLAGS, "-p", str(pid), "-x", str(script)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                     start_new_session=True, **as_target(pid))
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _interrupt(proc)
        raise UnavailableError(
            f"process {pid} reached no safe point within {timeout_s:g}s (none of its threads released the "
            "interpreter lock: it is busy in pure Python code, or idle); memwatch ran nothing in it and left it "
            "running as it was; retry while it serves, or raise --inject-timeout") from None
    if XSTATE_REFUSED in output:
        raise UnavailableError(
            f"gdb could not call into process {pid}: the kernel refused its write-back of the CPU's extended "
            "registers (gdb before 14 does not know the AMX-sized XSAVE area of this CPU); install gdb 14 or "
            "newer, or run the engine on Python 3.14 (memwatch then uses sys.remote_exec); the process runs on "
            "unobserved")
    if proc.returncode != 0 or "ptrace:" in output:
        reason = next((line.strip() for line in output.splitlines() if "ptrace" in line or "rror" in line),
                      f"gdb exited with {proc.returncode}")
        raise UnavailableError(f"gdb could not inject into process {pid} ({reason}); the process runs on unobserved")


def _interrupt(proc: subprocess.Popen[str]) -> None:
    """Stop gdb the way Ctrl-C does (it unwinds the pending call and detaches), then for good."""
    try:
        os.kill(proc.pid, signal.SIGINT)
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def remote_exec_interpreter(target: Target) -> TrustedFile:
    """The interpreter that calls ``sys.remote_exec``, open: memwatch's own when it is the same version, else the
    target's.

    The target's binary then runs as the target's user (see :func:`.programs.as_target`), from the descriptor
    of the very file the process runs, and only when that file and every folder above it belong to that user
    or to root and no one else may write them.
    """
    if sys.version_info[:2] == target.version and hasattr(sys, "remote_exec"):
        return own_interpreter()
    uids, _ = process_ids(target.pid)
    try:
        return open_interpreter(target.pid, owners=(0, *uids[:1]))
    except (OSError, UntrustedError):
        raise UnavailableError(f"process {target.pid} runs {target.exe}, which another user may change, and memwatch "
                               f"runs Python {sys.version_info[0]}.{sys.version_info[1]}, not "
                               f"{target.version[0]}.{target.version[1]}; run memwatch with the process's Python") \
            from None


def _through_remote_exec(target: Target, script: Path, timeout_s: float) -> None:
    call = f"import sys; sys.remote_exec({target.pid}, {str(script)!r})"
    with remote_exec_interpreter(target) as interpreter:
        proc = start(interpreter, ["-I", "-S", "-c", call], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, **as_target(target.pid))
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise UnavailableError(f"sys.remote_exec did not reach process {target.pid} within {timeout_s:g}s; "
                               "retry, or raise --inject-timeout") from None
    if proc.returncode != 0:
        reason = (stderr.strip().splitlines() or ["no message"])[-1]
        raise UnavailableError(f"sys.remote_exec into process {target.pid} failed ({reason}); "
                               "the process runs on unobserved")


def _write_private(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


HELPER_PROCESSES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Python children that never hold a rank: they wait in a read for good, so they never reach a safe point."""


def _python_children(pid: int) -> list[int]:
    """The descendants that may be ranks: every one but multiprocessing's own helpers."""
    from .hostinfo import HostWatcher

    ranks = []
    for child in sorted(HostWatcher(pid).children()):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if not any(helper in cmdline for helper in HELPER_PROCESSES):
            ranks.append(child)
    return ranks
