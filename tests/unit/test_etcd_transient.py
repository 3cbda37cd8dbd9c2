"""Which etcd failures are worth a second try, and a lease renewal retried until the lease's end.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_etcd_late_answers.py (a real etcd behind a proxy that holds its answers back).
"""

from __future__ import annotations

import grpc
import pytest
from pyetcd import exceptions as etcd_exc
from support.clock import FakeClock

from elasticctl.errors import LeaseNotFoundError
from elasticctl.etcd.client import LeaseExpiredError, lease_expired_message, transient
from elasticctl.etcd.retry import Attempts, Backoff, retry_until

Code = grpc.StatusCode


class Status(grpc.RpcError):
    """A grpc error as the channel raises it: a code and etcd's details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def from_grpc(pyetcd_error: type[Exception], code: grpc.StatusCode, details: str) -> Exception:
    """``pyetcd_error`` as pyetcd raises it: from inside its handler of the grpc error."""
    try:
        try:
            raise Status(code, details)
        except grpc.RpcError:
            raise pyetcd_error()  # noqa: B904 - as pyetcd does: the grpc error is only the context
    except pyetcd_error as exc:
        return exc


@pytest.mark.parametrize("error, expected", [
    # etcd answered late or not at all, or is between leaders: another try may succeed
    (Status(Code.UNKNOWN, "context deadline exceeded"), True),  # LeaseKeepAlive under load
    (Status(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"), True),  # this client's own deadline
    (Status(Code.UNAVAILABLE, "etcdserver: leader changed"), True),
    (Status(Code.UNAVAILABLE, "etcdserver: request timed out"), True),
    (Status(Code.UNAVAILABLE, "failed to connect to all addresses"), True),
    (Status(Code.FAILED_PRECONDITION, "etcdserver: not leader"), True),
    (Status(Code.RESOURCE_EXHAUSTED, "etcdserver: too many requests"), True),
    (Status(Code.INTERNAL, "Received RST_STREAM with error code 2"), True),
    # pyetcd's exceptions: the grpc status they were raised from decides, else their type
    (from_grpc(etcd_exc.ConnectionTimeoutError, Code.DEADLINE_EXCEEDED, "Deadline Exceeded"), True),
    (from_grpc(etcd_exc.ConnectionFailedError, Code.UNAVAILABLE, "etcdserver: no leader"), True),
    (from_grpc(etcd_exc.PreconditionFailedError, Code.FAILED_PRECONDITION, "etcdserver: not leader"), True),
    (etcd_exc.NoServerAvailableError("No endpoint available and not failed"), True),
    (etcd_exc.ConnectionFailedError(), True),
    # refusals: the same request would be refused again
    (Status(Code.NOT_FOUND, "etcdserver: requested lease not found"), False),
    (Status(Code.PERMISSION_DENIED, "etcdserver: permission denied"), False),
    (Status(Code.INVALID_ARGUMENT, "etcdserver: key is not provided"), False),
    (Status(Code.RESOURCE_EXHAUSTED, "Received message larger than max (5000000 vs. 4194304)"), False),
    (Status(Code.UNAUTHENTICATED, "etcdserver: invalid auth token"), False),  # the client logs in again itself
    (Status(Code.CANCELLED, "Locally cancelled by application!"), False),  # this process closed it
    (from_grpc(etcd_exc.PreconditionFailedError, Code.FAILED_PRECONDITION, "etcdserver: duplicate key given in txn request"), False),
    (etcd_exc.RevisionCompactedError(5), False),
    (LeaseNotFoundError("etcd at h:1 refused to renew a lease: etcdserver: requested lease not found."), False),
    (ValueError("not etcd's"), False),
])
def test_transient_failures_are_told_from_refusals(error, expected):
    assert transient(error) is expected


LATE = Status(Code.UNKNOWN, "context deadline exceeded")
GONE = Status(Code.NOT_FOUND, "etcdserver: requested lease not found")


def renew(outcomes, until, attempt_takes, backoff=Backoff(0.125, 1.0)):
    """retry_until as a lease renewal runs it, on a fake clock from 0: each attempt takes
    ``attempt_takes`` s and fails with the next of ``outcomes`` (an error) or returns it."""
    clock = FakeClock(0.0)
    attempted_at = []
    outcomes = iter(outcomes)

    def attempt():
        attempted_at.append(clock.now)
        clock.advance(attempt_takes)
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def give_up(attempts: Attempts) -> LeaseExpiredError:
        return LeaseExpiredError(lease_expired_message("rendezvous lease", 0x694D, "127.0.0.1:2379", attempts))

    try:
        result = retry_until(attempt, transient, until, backoff, give_up, clock=clock, sleep=clock.sleep)
    except Exception as exc:  # noqa: BLE001 - the test compares what came out
        result = exc
    return result, attempted_at, clock.pauses


# Times in binary fractions: the fake clock adds them exactly. The renewal starts at 0; the lease
# ends, less the margin, at ``until``.
@pytest.mark.parametrize("until, attempt_takes, fail, attempted_at, pauses, result", [
    # etcd answers late twice (each attempt runs out the client's 1 s), then in time: the lease is kept
    (5.5, 1.0, 2, [0, 1.125, 2.375], [0.125, 0.25], 30),
    # answers come back at once, failed, until etcd recovers: the backoff, no more
    (5.5, 0.0, 3, [0, 0.125, 0.375, 0.875], [0.125, 0.25, 0.5], 30),
    # etcd never answers in time: the last pause is cut so that the last attempt starts at the
    # lease's end less the margin, and its failure gives up
    (5.5, 1.0, 9, [0, 1.125, 2.375, 3.875, 5.5], [0.125, 0.25, 0.5, 0.625],
     "The rendezvous lease 694d expired before etcd at 127.0.0.1:2379 answered a renewal: "
     "5 attempts over 6.5 s, the last: unknown: context deadline exceeded."),
    # the lease's end passed already (the keeper gave up before): one attempt still, as the end
    # was an estimate; its failure is final
    (-1.0, 0.0, 9, [0], [],
     "The rendezvous lease 694d expired before etcd at 127.0.0.1:2379 answered a renewal: "
     "1 attempt over 0.0 s, the last: unknown: context deadline exceeded."),
])
def test_a_renewal_is_retried_until_the_lease_ends(until, attempt_takes, fail, attempted_at, pauses, result):
    got, at, slept = renew([LATE] * fail + [30], until, attempt_takes)
    assert at == attempted_at and slept == pauses
    if isinstance(result, str):
        assert isinstance(got, LeaseExpiredError) and str(got) == result
        assert got.__cause__ is LATE  # the last error stays readable in the traceback
    else:
        assert got == result


def test_a_refused_renewal_fails_at_once():
    # etcd says the lease is gone: retrying cannot bring it back, however long the lease had
    got, at, slept = renew([LATE, GONE, 30], until=100.0, attempt_takes=0.0)
    assert got is GONE and at == [0, 0.125] and slept == [0.125]


def test_the_message_is_one_sentence_with_one_attempt_or_several():
    for count in (1, 2):
        message = lease_expired_message("node lease", 1, "h:1", Attempts(count, 2.25, LATE))
        assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message
        assert (f"{count} attempt " if count == 1 else f"{count} attempts ") in message
