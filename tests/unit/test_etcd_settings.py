"""The etcd client and the embedded server: endpoints, TLS, failover across members, bad input.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_etcd.py.
"""

from __future__ import annotations

import pytest
from support.clock import FakeClock

from elasticctl.errors import ConfigError, EtcdServerError, EtcdUnavailableError
from elasticctl.etcd.client import EtcdClient, EtcdSettings, parse_endpoints
from elasticctl.etcd.retry import Backoff, poll, retry
from elasticctl.embedded_etcd import find_etcd_binary, free_port


def test_parse_endpoints_accepts_lists_schemes_and_ipv6():
    endpoints, scheme = parse_endpoints("h1:2379, h2 ,https://[::1]:2400")
    assert [str(e) for e in endpoints] == ["h1:2379", "h2:2379", "[::1]:2400"]
    assert scheme == "https"


@pytest.mark.parametrize("text", ["", "h1:", "h1:abc", "h1:2379:1", "h1:99999", "http://a:1,https://b:2"])
def test_bad_endpoints_are_one_sentence_errors_naming_the_value(text):
    with pytest.raises(ConfigError) as info:
        EtcdSettings.from_string(text)
    message = str(info.value)
    assert message.endswith(".") and "\n" not in message
    assert text.split(",")[0] in message or text == ""


def test_half_given_credentials_are_refused():
    with pytest.raises(ConfigError, match="together"):
        EtcdSettings.from_string("h:1", user="root")
    with pytest.raises(ConfigError, match="together"):
        EtcdSettings.from_string("h:1", cert="c.pem")


def test_unreachable_endpoint_error_names_it():
    port = free_port()
    client = EtcdClient(EtcdSettings.from_string(f"127.0.0.1:{port}", retry_timeout=0.5, read_timeout=0.5))
    with pytest.raises(EtcdUnavailableError, match=f"127.0.0.1:{port}"):
        client.get("k")


def test_a_missing_etcd_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICCTL_ETCD_BINARY", str(tmp_path / "no-etcd-here"))
    with pytest.raises(EtcdServerError, match="no-etcd-here"):
        find_etcd_binary()


# Schedules in binary fractions (1/8 s and its multiples): the fake clock adds them exactly, so
# the times and pauses below are equalities, not windows.
@pytest.mark.parametrize("timeout, backoff, attempt_takes, attempted_at, pauses", [
    # 1/8, 1/4, 1/2, then the next 1/2 cut to the deadline: the last attempt is at it, no pause after
    (1.0, Backoff(0.125, 0.5), 0.0, [0, 0.125, 0.375, 0.875, 1.0], [0.125, 0.25, 0.5, 0.125]),
    # a fixed pause
    (0.5, Backoff(0.25), 0.0, [0, 0.25, 0.5], [0.25, 0.25]),
    # no pause at all: attempts back to back, the one that ends at the deadline is the last
    (0.5, Backoff(0.0), 0.25, [0, 0.25], [0.0]),
    # an attempt that takes a while: the pause is cut to what is left, and one that ends past
    # the deadline is the last
    (1.0, Backoff(0.5), 0.375, [0, 0.875], [0.5]),
    # a timeout of 0: one attempt, no pause
    (0.0, Backoff(1.0), 0.0, [0], []),
])
def test_retry_raises_the_last_error_at_the_deadline_and_never_sleeps_past_it(
        timeout, backoff, attempt_takes, attempted_at, pauses):
    clock = FakeClock()
    began = clock.now
    calls = []

    def failing():
        calls.append(clock.now - began)
        clock.advance(attempt_takes)
        raise EtcdUnavailableError(f"attempt {len(calls)}")

    with pytest.raises(EtcdUnavailableError, match=rf"attempt {len(attempted_at)}$"):
        retry(failing, EtcdUnavailableError, timeout, backoff, clock=clock, sleep=clock.sleep)
    assert calls == attempted_at
    assert clock.pauses == pauses


def test_retry_returns_the_first_success_and_reports_each_retry():
    clock = FakeClock()
    outcomes = iter([EtcdUnavailableError("one"), EtcdUnavailableError("two"), "value"])
    retried = []

    def attempt():
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert retry(attempt, EtcdUnavailableError, 5, Backoff(0.125, 1.0), on_retry=lambda e: retried.append(str(e)),
                 clock=clock, sleep=clock.sleep) == "value"
    assert retried == ["one", "two"] and clock.pauses == [0.125, 0.25]


def test_retry_lets_an_error_it_does_not_retry_through_at_once():
    clock = FakeClock()
    with pytest.raises(ConfigError):
        retry(lambda: (_ for _ in ()).throw(ConfigError("bad")), EtcdUnavailableError, 5, Backoff(1),
              clock=clock, sleep=clock.sleep)
    assert clock.pauses == []


@pytest.mark.parametrize("timeout, backoff, accept_at, read_at, pauses, result", [
    # never accepted: the last read is at the deadline, and its result is returned
    (0.75, Backoff(0.25), None, [0, 0.25, 0.5, 0.75], [0.25, 0.25, 0.25], None),
    # doubling, the last pause cut to the deadline
    (1.0, Backoff(0.125, 0.5), None, [0, 0.125, 0.375, 0.875, 1.0], [0.125, 0.25, 0.5, 0.125], None),
    # accepted at the third read: no pause after it
    (5.0, Backoff(0.25), 2, [0, 0.25, 0.5], [0.25, 0.25], 2),
    # accepted at once
    (5.0, Backoff(0.25), 0, [0], [], 0),
])
def test_poll_returns_the_first_accepted_value_or_the_last_one_at_the_deadline(
        timeout, backoff, accept_at, read_at, pauses, result):
    clock = FakeClock()
    began = clock.now
    reads = []

    def read():
        reads.append(clock.now - began)
        return len(reads) - 1

    until = (lambda v: False) if accept_at is None else (lambda v: v == accept_at)
    got = poll(read, timeout, backoff, until=until, clock=clock, sleep=clock.sleep)
    assert reads == read_at and clock.pauses == pauses
    assert got == (len(read_at) - 1 if result is None else result)  # never accepted: the last one read


def test_poll_by_default_accepts_a_true_value():
    clock = FakeClock()
    values = iter([None, 0, "", "found"])
    assert poll(lambda: next(values), 5, Backoff(0.5), clock=clock, sleep=clock.sleep) == "found"
    assert clock.pauses == [0.5, 0.5, 0.5]
