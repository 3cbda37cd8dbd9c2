"""The address a node advertises, on a host with a Docker bridge beside its real interface.

Host a (a namespace) has ``eth0`` (its end of a veth to the bridge that joins it to host b)
and ``docker0``, a bridge with Docker's 172.17.0.1 that is up: ``docker0`` sorts before
``eth0``, and its address is one no other host can reach. Host a's default route leads out
through ``eth0`` (via b), as a real host's does. Everything lives in namespaces this test makes
and removes, on 10.203.0.0/24; the root namespace never sees an interface, address or route.

Every wait is on a log line, the record or a process's exit, never a sleep.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys

import pytest
from support.helpers import MLP, read_records, wait_for
from support.netns import Topology, existing_namespaces, sweep_stale, unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="the 'ip' binary (iproute2) is not installed"),
]

ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]
SUBNET = "10.203.0"
DOCKER_ADDR = "172.17.0.1"
STEPS = 20
TRAIN = [MLP, "--steps", str(STEPS), "--log-every", "0", "--batch-size", "8"]


@pytest.fixture
def hosts():
    """Hosts a and b on one bridge, a with a Docker bridge of its own and a default route."""
    sweep_stale()
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    topology = Topology(hosts=["a", "b"], subnet=SUBNET, prefix="ecaddr" + secrets.token_hex(3))
    try:
        topology.create()
        a = topology.ns("a")
        for command in (["link", "add", "docker0", "type", "bridge"],
                        ["addr", "add", f"{DOCKER_ADDR}/16", "dev", "docker0"],
                        ["link", "set", "docker0", "up"],
                        ["route", "add", "default", "via", topology.addr("b"), "dev", "eth0"]):
            result = topology.run("a", ["ip", *command])
            assert result.returncode == 0, f"ip {' '.join(command)} in {a}: {result.stderr}"
        yield topology
    finally:
        # Deleting a namespace deletes its links (docker0, the veth's end) and routes with it.
        if topology.ns("a") in topology.namespaces():
            topology.run("a", ["ip", "link", "del", "docker0"])
        topology.destroy()
        assert existing_namespaces(topology.prefix) == []


def _flag(command_line: str, flag: str) -> str:
    return next(word.split("=", 1)[1] for word in command_line.split() if word.startswith(f"{flag}="))


def test_the_bridge_sorts_first_but_the_routable_address_is_advertised(hosts, tmp_path):
    a_addr, b_addr = hosts.addr("a"), hosts.addr("b")
    interfaces = hosts.run("a", ["ip", "-4", "-o", "addr", "show"]).stdout
    assert "docker0" in interfaces and DOCKER_ADDR in interfaces, interfaces

    # The embedded etcd: the default route's source, in torchrun's --local-addr and in etcd's endpoint.
    dry = hosts.run("a", [*ELASTICCTL, "up", "--dry-run", "--nnodes", "2", *TRAIN])
    assert dry.returncode == 0, dry.stderr
    assert _flag(dry.stdout, "--local-addr") == a_addr, dry.stdout
    assert _flag(dry.stdout, "--rdzv-endpoint") == f"{a_addr}:2379", dry.stdout
    assert DOCKER_ADDR not in dry.stdout
    # An etcd on another host: the source of the route to it.
    dry = hosts.run("a", [*ELASTICCTL, "up", "--dry-run", "--etcd", f"{b_addr}:2379", "--nnodes", "2", *TRAIN])
    assert dry.returncode == 0, dry.stderr
    assert _flag(dry.stdout, "--local-addr") == a_addr, dry.stdout

    # The job: `up` with its embedded etcd on a, `join` on b, the bridge present all along.
    record = tmp_path / "record.jsonl"
    job = "addr-" + hosts.prefix
    up = hosts.spawn("a", "a", [*ELASTICCTL, "up", "--job", job, "--node-id", "a", "--nnodes", "2", *TRAIN, "--record", str(record)],
                     tmp_path)
    join_line = f"  elasticctl join --etcd {a_addr}:2379 --job {job}"
    wait_for(lambda: join_line in up.log().splitlines() or up.process.poll() is not None, 120,
             "a's join line")
    assert up.process.poll() is None, up.log()
    assert f"advertising {a_addr} (the source of this host's default route)" in up.log()
    assert DOCKER_ADDR not in up.log()

    # doctor on a, while a waits for b: the default passes; docker0's address is warned about
    # twice over (a bridge, and not the address etcd sees a connect from).
    endpoint = f"{a_addr}:2379"
    checks = _doctor(hosts, "--etcd", endpoint, "--job", job)
    assert checks["address"]["status"] == "pass", checks["address"]
    assert f"advertising {a_addr} on eth0" in checks["address"]["detail"]
    checks = _doctor(hosts, "--etcd", endpoint, "--job", job, "--local-addr", DOCKER_ADDR)
    assert checks["address"]["status"] == "warn", checks["address"]
    assert (f"the advertised address {DOCKER_ADDR} is on docker0, a bridge interface that other hosts usually "
            "cannot reach") in checks["address"]["detail"]
    assert (f"etcd at {endpoint} sees this host connect from {a_addr}, not from the advertised {DOCKER_ADDR}"
            in checks["address"]["detail"])

    join = hosts.spawn("b", "b", [*ELASTICCTL, "join", "--etcd", endpoint, "--job", job, "--node-id", "b"], tmp_path)
    assert up.wait(240) == 0, up.log()
    assert join.wait(60) == 0, join.log()
    assert f"advertising {b_addr} (the source of this host's route to etcd at {a_addr})" in join.log()

    steps = [r for r in read_records(record) if "step" in r and "event" not in r]
    assert {r["node"] for r in steps} == {"a", "b"}
    assert {r["world_size"] for r in steps} == {2}
    assert {(r["node"], r["step"]) for r in steps} == {(n, s) for n in ("a", "b") for s in range(STEPS)}


def _doctor(hosts: Topology, *args: str) -> dict[str, dict]:
    result = hosts.run("a", [*ELASTICCTL, "doctor", "--json", *args], timeout=120)
    assert "Traceback" not in result.stderr, result.stderr
    return {c["name"]: c for c in json.loads(result.stdout)}
