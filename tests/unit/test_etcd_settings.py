"""The etcd client and the embedded server: endpoints, TLS, failover across members, bad input.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_etcd.py.
"""

from __future__ import annotations

import time

import pytest

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


def test_retry_raises_the_last_error_at_the_deadline_and_never_sleeps_past_it():
    calls = []

    def failing():
        calls.append(time.monotonic())
        raise EtcdUnavailableError(f"attempt {len(calls)}")

    began = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=r"attempt \d+"):
        retry(failing, EtcdUnavailableError, 0.5, Backoff(0.05, 0.4))
    assert 0.5 <= time.monotonic() - began < 0.7
    assert 4 <= len(calls) <= 6  # pauses of 0.05, 0.1, 0.2, then 0.4 cut to the deadline
    with pytest.raises(ConfigError):  # an error not retried goes through at once
        retry(lambda: (_ for _ in ()).throw(ConfigError("bad")), EtcdUnavailableError, 5, Backoff(1))


def test_poll_returns_the_first_accepted_value_or_the_last_one_at_the_deadline():
    values = iter(range(100))
    assert poll(lambda: next(values), 5, Backoff(0.0), until=lambda v: v == 3) == 3
    began = time.monotonic()
    assert poll(lambda: None, 0.3, Backoff(0.1)) is None
    assert 0.3 <= time.monotonic() - began < 0.5
