"""Costly answers shared by every request for their path, on real worker threads: one render at a time per path,
a bound on what waits, and a stop that answers nothing more."""

from __future__ import annotations

import threading
import time

from memwatch.export.shared_answers import QUEUED, WORKERS, SharedAnswers


class Renders:
    """A ``make`` that blocks until released and counts its calls; a ``deliver`` that records what it was given."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.made: list[str] = []
        self.delivered: list[tuple[list[str], str]] = []
        self.lock = threading.Lock()

    def make(self, path: str) -> str:
        with self.lock:
            self.made.append(path)
        self.release.wait(10)
        return f"answer to {path}"

    def deliver(self, waiters: list[str], answer: str) -> None:
        with self.lock:
            self.delivered.append((waiters, answer))


def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_requests_for_a_path_share_its_next_answer_and_one_render_runs_at_a_time() -> None:
    renders = Renders()
    answers = SharedAnswers("answers", renders.make, renders.deliver)
    answers.start()
    try:
        assert answers.add("/metrics", "a")
        _until(lambda: renders.made == ["/metrics"])  # a's render has begun: b and c wait for the next one
        assert answers.add("/metrics", "b") and answers.add("/metrics", "c")
        assert answers.in_flight == 2
        renders.release.set()
        _until(lambda: len(renders.delivered) == 2)
        assert renders.delivered == [(["a"], "answer to /metrics"), (["b", "c"], "answer to /metrics")]
        assert renders.made == ["/metrics", "/metrics"]  # never two renders of one path at once, even with 4 workers
        assert answers.in_flight == 0
    finally:
        renders.release.set()
        for thread in answers.stop():
            thread.join(5)


def test_beyond_workers_plus_queued_paths_a_new_path_is_refused_but_a_waiting_one_is_joined() -> None:
    renders = Renders()
    answers = SharedAnswers("answers", renders.make, renders.deliver)
    answers.start()
    try:
        for n in range(WORKERS + QUEUED):
            assert answers.add(f"/p{n}", f"w{n}")
        assert answers.in_flight == WORKERS + QUEUED == 68
        assert not answers.add("/another", "x")
        _until(lambda: len(renders.made) == WORKERS)
        assert answers.add(f"/p{WORKERS + QUEUED - 1}", "joined")  # still waiting: it joins, costing nothing
        assert answers.in_flight == 68
        renders.release.set()
        _until(lambda: len(renders.delivered) == 68)
        assert (["w67", "joined"], "answer to /p67") in renders.delivered
    finally:
        renders.release.set()
        for thread in answers.stop():
            thread.join(5)


def test_a_stop_ends_every_worker_and_answers_nothing_queued_before_it() -> None:
    renders = Renders()
    answers = SharedAnswers("answers", renders.make, renders.deliver)
    answers.start()
    for n in range(WORKERS + 2):  # four renders begin, two wait for a worker
        answers.add(f"/p{n}", f"w{n}")
    _until(lambda: len(renders.made) == WORKERS)
    threads = answers.stop()
    assert sorted(thread.name for thread in threads) == [f"answers-{i}" for i in range(WORKERS)]
    assert all(thread.daemon for thread in threads)  # a render stuck for ever never keeps the process alive
    renders.release.set()
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(path for path in renders.made) == [f"/p{n}" for n in range(WORKERS)]  # the two waiting: never made
    assert answers.stop() == []  # a second stop has no threads left


def test_a_worker_whose_loop_has_closed_ends() -> None:
    def closed(waiters: list[str], answer: str) -> None:
        raise RuntimeError("Event loop is closed")

    made: list[str] = []
    answers = SharedAnswers("answers", lambda path: made.append(path) or path, closed)
    answers.start()
    for n in range(WORKERS):
        answers.add(f"/p{n}", "w")
    threads = list(answers._threads)
    for thread in threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in threads) and sorted(made) == [f"/p{n}" for n in range(WORKERS)]
    answers.stop()
