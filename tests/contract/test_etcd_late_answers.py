"""etcd answering late: a lease holder rides it out while its lease lives, replaces it once etcd
answers that it ended, and fails in one sentence only when etcd stays silent for the client's
retry_timeout; a grant tried again is not granted twice.

Layer tests/contract: a real etcd, reached through a proxy on loopback that holds its bytes back
(tests/support/tcp_proxy.py), no training processes. The other tests of this subject:
tests/unit/test_etcd_transient.py (which failures are retried, and the schedule on a fake clock).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import pytest
from support.helpers import etcd_metric, wait_for
from support.tcp_proxy import SlowProxy

from elasticctl.etcd.client import EtcdClient, EtcdSettings, LeaseExpiredError
from elasticctl.etcd.lease import Lease

# The client's own per-request timeout: an answer held back longer than this is a failed attempt.
READ_TIMEOUT = 0.5


@pytest.fixture
def proxy(etcd_server):
    with SlowProxy("127.0.0.1", etcd_server.client_port) as proxy:
        yield proxy


def through(proxy: SlowProxy, etcd_server, **options) -> EtcdClient:
    settings = etcd_server.client_settings(read_timeout=READ_TIMEOUT, **options)
    return EtcdClient(dataclasses.replace(settings, endpoints=EtcdSettings.from_string(proxy.endpoint).endpoints))


def test_late_answers_do_not_end_a_lease_holder_while_its_lease_lives(etcd_server, etcd_client, proxy, caplog,
                                                                      run_id):
    # etcd holds its answers back 1.5 s (3 times the client's timeout: every request in that
    # while fails) for 3 s, well inside the leases' 10 s.
    ttl, holders = 10, 3
    client = through(proxy, etcd_server, retry_timeout=30.0)
    # renew_every 0: each id() renews, as a rendezvous write does once a renewal is due
    leases = [Lease(client, ttl, renew_every=0.0, name="rendezvous lease") for _ in range(holders)]
    for i, lease in enumerate(leases):
        lease.put(f"/{run_id}/late/{i}", b"declared")
    ids = [lease.id() for lease in leases]
    caplog.set_level(logging.DEBUG, logger="elasticctl.etcd.client")
    failures: list[BaseException] = []
    renewed: list[int] = []

    def hold(lease: Lease) -> None:
        # id() is what the rendezvous calls before each write bound to the lease
        try:
            renewed.append(lease.id())
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failures.append(exc)

    try:
        proxy.delay = 1.5
        threads = [threading.Thread(target=hold, args=(lease,)) for lease in leases]
        for thread in threads:
            thread.start()
        time.sleep(3.0)
        proxy.delay = 0.0
        for thread in threads:
            thread.join(timeout=ttl)
        assert failures == [] and sorted(renewed) == sorted(ids)
        # the slowness was felt: renewals failed and were tried again
        assert any("renew a lease failed" in r.getMessage() for r in caplog.records)
        # and the leases live on, their keys with them, renewed during or after the slow while
        for i, lease_id in enumerate(ids):
            assert etcd_client.get(f"/{run_id}/late/{i}").lease == lease_id
            remaining, granted = etcd_client.lease_ttl(lease_id)
            assert granted == ttl and remaining >= ttl - 2
    finally:
        for lease in leases:
            lease.stop(revoke=True)
        client.close()


def test_a_lease_that_ended_unanswered_is_replaced_once_etcd_answers(etcd_server, etcd_client, proxy, run_id):
    # etcd answers nothing for longer than the lease lives, then answers again: the holder does
    # not fail at its lease's end but asks on, learns that the lease is gone, and holds a new one
    # with its key written again (as the rendezvous writes its declaration again).
    ttl = 3
    client = through(proxy, etcd_server, retry_timeout=30.0)
    lease = Lease(client, ttl, renew_every=0.0, name="rendezvous lease")
    key = f"/{run_id}/late/declared"
    lease.put(key, b"declared")
    lost = lease.id()
    regranted: list[int] = []
    lease.on_regrant(lambda new: (regranted.append(new), client.put(key, b"declared", lease=new)))
    held: list[int] = []
    failures: list[BaseException] = []

    def hold() -> None:
        try:
            held.append(lease.id())
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failures.append(exc)

    proxy.delay = 2 * ttl
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        # the lease ends at etcd while its renewals go unanswered
        wait_for(lambda: etcd_client.get(key) is None, 15, f"etcd to drop {key} with its lease")
        assert holder.is_alive() and failures == [], "the holder gave up at its lease's end"
        proxy.delay = 0.0
        holder.join(timeout=30)
        assert failures == [] and held != [] and held[0] != lost and regranted == held
        assert etcd_client.get(key).lease == held[0]
        assert etcd_client.lease_ttl(lost)[0] <= 0  # gone, not kept alive beside the new one
    finally:
        proxy.delay = 0.0
        holder.join(timeout=30)
        lease.stop(revoke=True)
        client.close(timeout=1.0)


def test_a_lease_unanswered_for_the_retry_timeout_fails_in_one_sentence(etcd_server, etcd_client, proxy, run_id):
    # etcd answers nothing for longer than the lease lives and than the client retries: the
    # renewal gives up at retry_timeout and says that the lease ended unanswered.
    ttl, retry_timeout = 3, 5.0
    client = through(proxy, etcd_server, retry_timeout=retry_timeout)
    lease = Lease(client, ttl, renew_every=0.0, name="rendezvous lease")
    key = f"/{run_id}/late/gone"
    lease.put(key, b"declared")
    lease_id = lease.id()
    began = time.monotonic()
    try:
        proxy.delay = 60.0
        with pytest.raises(LeaseExpiredError) as info:
            lease.id()
        took = time.monotonic() - began
        message = str(info.value)
        assert re.fullmatch(
            rf"The rendezvous lease {lease_id:x} expired before etcd at {re.escape(proxy.endpoint)} answered a "
            r"renewal: \d+ attempts over \d+\.\d s, the last: [^\n]+\.", message), message
        assert took < retry_timeout + 2 * READ_TIMEOUT + 1, f"it gave up {took:.1f} s after the last renewal"
        # it had indeed ended: etcd dropped the key bound to it
        wait_for(lambda: etcd_client.get(key) is None, 10, f"etcd to drop {key} with its lease")
    finally:
        proxy.delay = 0.0
        lease.stop()
        client.close(timeout=1.0)


LEASES_GRANTED = r"etcd_debugging_lease_granted_total"
GRANT_REQUESTS = r'grpc_server_started_total\{grpc_method="LeaseGrant"[^}]*\}'


def test_a_grant_that_etcd_answered_late_is_taken_by_its_retry_not_granted_again(etcd_server, etcd_client, proxy):
    client = through(proxy, etcd_server, retry_timeout=30.0)
    granted_before = etcd_metric(etcd_server, LEASES_GRANTED)
    requests_before = etcd_metric(etcd_server, GRANT_REQUESTS)
    granted: list[int] = []
    client.get("/connected")  # the connection is up: the first attempt is sent at once
    proxy.delay = 1.5  # the first attempt reaches etcd and is applied; its answer comes too late
    granting = threading.Thread(target=lambda: granted.append(client.grant_lease(10)))
    granting.start()
    try:
        wait_for(lambda: etcd_metric(etcd_server, GRANT_REQUESTS) - requests_before >= 1, 20,
                 "the first grant request reaching etcd")
        proxy.delay = 0.0  # the retry is answered at once
        granting.join(timeout=30)
        assert len(granted) == 1
        assert etcd_metric(etcd_server, GRANT_REQUESTS) - requests_before >= 2, "the grant was not tried again"
        assert etcd_metric(etcd_server, LEASES_GRANTED) - granted_before == 1, "a retried grant granted again"
        remaining, ttl = etcd_client.lease_ttl(granted[0])
        assert ttl == 10 and remaining > 0
    finally:
        proxy.delay = 0.0
        granting.join(timeout=30)
        for lease_id in granted:
            etcd_client.revoke_lease(lease_id)
        client.close()
