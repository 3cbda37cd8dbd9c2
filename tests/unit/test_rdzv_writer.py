"""The rendezvous view's writer: the ctl/reform publish runs off the watch thread,
latest-wins. Real threads, no etcd: the task is a function the test holds up at will."""

from __future__ import annotations

import threading

from elasticctl.rendezvous.writer import LatestWinsWriter


class HeldTask:
    """A task that signals each start and waits until the test lets it finish."""

    def __init__(self, fail_first: bool = False) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.calls = 0
        self.fail_first = fail_first

    def __call__(self) -> None:
        self.calls += 1
        self.started.release()
        assert self.release.acquire(timeout=10), "the test never let the task finish"
        if self.fail_first and self.calls == 1:
            raise RuntimeError("etcd said no")


def test_a_request_returns_while_the_task_runs_and_requests_meanwhile_collapse_into_one_run():
    task = HeldTask()
    writer = LatestWinsWriter(task, "test-writer")
    writer.request()
    assert task.started.acquire(timeout=10)  # running, and held: the request did not wait for it
    for _ in range(50):  # a burst of watch events while the write is slow
        writer.request()
    task.release.release()
    assert task.started.acquire(timeout=10)  # exactly one more run for the whole burst
    task.release.release()
    assert not task.started.acquire(timeout=0.3), "the burst ran the task more than once"
    assert task.calls == 2
    writer.stop(timeout=10)


def test_a_failed_run_is_logged_and_the_next_request_runs_again():
    task = HeldTask(fail_first=True)
    writer = LatestWinsWriter(task, "test-writer")
    writer.request()
    assert task.started.acquire(timeout=10)
    task.release.release()  # the first run raises
    writer.request()
    assert task.started.acquire(timeout=10), "the writer died with its failed run"
    task.release.release()
    writer.stop(timeout=10)
    assert task.calls == 2


def test_stop_ends_the_thread_and_later_requests_do_nothing():
    task = HeldTask()
    writer = LatestWinsWriter(task, "test-writer")
    writer.stop(timeout=1)  # never started: nothing to join
    writer.request()
    assert task.calls == 0 and writer._thread is None

    started = LatestWinsWriter(task, "test-writer")
    started.request()
    assert task.started.acquire(timeout=10)
    started.request()  # wanted again, but the writer stops before it runs
    started.stop(timeout=0)  # stopped now; the run in progress still finishes
    task.release.release()
    started.stop(timeout=10)
    assert not started._thread.is_alive()
    started.request()
    assert task.calls == 1
