"""Deadlines, and the two ways elasticctl waits on etcd: retrying a call, polling a value.

Every wait in elasticctl that a deadline bounds goes through :func:`retry`, :func:`retry_until`
or :func:`poll`: a pause never outlasts the deadline (the last attempt happens at it, not a pause
after it), and each caller keeps its own one-sentence error for when time runs out.

Each takes the clock it reads and the sleep it pauses with (``clock``, ``sleep``; the monotonic
clock and ``time.sleep`` by default), so that a test can drive them on a clock of its own and
check the exact schedule of pauses, whatever the machine's speed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

_T = TypeVar("_T")


class Deadline:
    """A moment ``seconds`` from now on ``clock`` (the monotonic clock), slept towards with ``sleep``."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.seconds = seconds
        self._clock, self._sleep = clock, sleep
        self._at = clock() + seconds

    def remaining(self) -> float:
        return max(0.0, self._at - self._clock())

    def passed(self) -> bool:
        return self._clock() >= self._at

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or until the deadline if that comes first."""
        self._sleep(min(seconds, self.remaining()))


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Pauses between attempts: ``first``, doubling up to ``longest`` (a fixed pause without it)."""

    first: float
    longest: float | None = None

    def pauses(self) -> Iterator[float]:
        pause = self.first
        while True:
            yield pause
            if self.longest is not None:
                pause = min(pause * 2, self.longest)


def retry(attempt: Callable[[], _T], retry_on: type[BaseException] | tuple[type[BaseException], ...],
          timeout: float, backoff: Backoff, on_retry: Callable[[BaseException], None] | None = None, *,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> _T:
    """``attempt()``'s result, calling it again after a ``retry_on`` error until ``timeout``
    seconds have passed; then that error is raised."""
    deadline = Deadline(timeout, clock=clock, sleep=sleep)
    for pause in backoff.pauses():
        try:
            return attempt()
        except retry_on as exc:
            if deadline.passed():
                raise
            if on_retry is not None:
                on_retry(exc)
        deadline.sleep(pause)
    raise AssertionError("unreachable: Backoff.pauses() never ends")


@dataclasses.dataclass(frozen=True)
class Attempts:
    """What a retry that ran out of time did: ``count`` attempts over ``seconds``, the last of
    them failing with ``last``."""

    count: int
    seconds: float
    last: BaseException


def retry_until(attempt: Callable[[], _T], transient: Callable[[BaseException], bool], until: float,
                backoff: Backoff, give_up: Callable[[Attempts], BaseException],
                on_retry: Callable[[BaseException], None] | None = None, *,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> _T:
    """``attempt()``'s result, calling it again after an error that ``transient`` accepts until
    ``clock()`` reads ``until``; then ``give_up(Attempts(...))`` is raised from the last error.
    An error ``transient`` refuses goes through at once.

    One attempt is always made, even past ``until``: a caller's deadline is an estimate (a lease's
    end as this process saw it), and only the answer says whether it was right. A pause is cut to
    what is left, so the last attempt starts at ``until`` at the latest.
    """
    began = clock()
    count = 0
    for pause in backoff.pauses():
        count += 1
        try:
            return attempt()
        except Exception as exc:
            if not transient(exc):
                raise
            now = clock()
            if now >= until:
                raise give_up(Attempts(count, now - began, exc)) from exc
            if on_retry is not None:
                on_retry(exc)
        sleep(min(pause, max(0.0, until - clock())))
    raise AssertionError("unreachable: Backoff.pauses() never ends")


def poll(read: Callable[[], _T], timeout: float, backoff: Backoff,
         until: Callable[[_T], object] = bool, *,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> _T:
    """The first result of ``read()`` that ``until`` accepts (by default: a true one), or its
    last result once ``timeout`` seconds have passed."""
    deadline = Deadline(timeout, clock=clock, sleep=sleep)
    for pause in backoff.pauses():
        result = read()
        if until(result) or deadline.passed():
            return result
        deadline.sleep(pause)
    raise AssertionError("unreachable: Backoff.pauses() never ends")
