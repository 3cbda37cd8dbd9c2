"""A clock of a test's own, for code that takes ``clock`` and ``sleep`` (elasticctl.etcd.retry,
elasticctl.train.groups.process_group.wait_until_listening): its sleep moves it on at once and keeps
the pause, so a test asserts the exact schedule of pauses and the deadline's behaviour rather
than a window of wall time, which a loaded machine leaves at random."""

from __future__ import annotations


class FakeClock:
    """Reads ``now``; ``sleep(s)`` records ``s`` and moves ``now`` on by it; ``advance(s)`` is
    time the code under test spends working (an attempt that takes a while)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0, f"a negative pause: {seconds}"  # time.sleep would raise ValueError
        self.pauses.append(seconds)
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds
