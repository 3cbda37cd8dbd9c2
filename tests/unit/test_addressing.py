"""The address a node advertises: the rule as a table, the kinds of interfaces, the default route
read from /proc/net/route's text, and the host readers on this host's loopback."""

from __future__ import annotations

import pytest

from elasticctl import addressing
from elasticctl.addressing import (
    BOND,
    BRIDGE,
    CONTAINER,
    LOOPBACK,
    PHYSICAL,
    TUNTAP,
    VIRTUAL,
    VLAN,
    NetInterface,
    choose_address,
    interface_kind,
    parse_default_gateway,
)

LO = NetInterface("lo", True, ("127.0.0.1", "::1"), LOOPBACK, loopback=True)
DOCKER0 = NetInterface("docker0", True, ("172.17.0.1",), BRIDGE)
ETH0 = NetInterface("eth0", True, ("10.0.0.5", "fe80::1"), PHYSICAL)
VETH = NetInterface("veth1a2b", True, ("169.254.3.1",), CONTAINER)
TUN0 = NetInterface("tun0", True, ("10.8.0.2",), TUNTAP)
ENS_DOWN = NetInterface("ens1", False, ("10.1.0.5",), PHYSICAL)
BOND0 = NetInterface("bond0", True, ("10.2.0.5",), BOND)
POD_ETH0 = NetInterface("eth0", True, ("10.244.1.7",), VIRTUAL)  # a pod's veth: no device behind it
V6_ONLY = NetInterface("eno1", True, ("2001:db8::5",), PHYSICAL)


@pytest.mark.parametrize(("given", "etcd_host", "source", "interfaces", "address", "reason"), [
    # --local-addr wins over everything, even a loopback etcd.
    ("10.9.9.9", "10.0.0.2", "10.0.0.5", (ETH0,), "10.9.9.9", "given with --local-addr"),
    ("10.9.9.9", "127.0.0.1", None, (), "10.9.9.9", "given with --local-addr"),
    # A loopback job stays on 127.0.0.1, as it always did.
    (None, "127.0.0.1", None, (DOCKER0, ETH0), "127.0.0.1", "etcd at 127.0.0.1 is on loopback"),
    (None, "localhost", None, (ETH0,), "127.0.0.1", "etcd at localhost is on loopback"),
    # etcd's name resolves to this host's loopback (Debian's 127.0.1.1): still one host.
    (None, "myhost", "127.0.1.1", (ETH0,), "127.0.0.1", "this host's route to etcd at myhost goes over loopback"),
    # The route's source, whatever sorts first: docker0 before eth0 no longer matters.
    (None, "10.0.0.2", "10.0.0.5", (DOCKER0, ETH0), "10.0.0.5", "the source of this host's route to etcd at 10.0.0.2"),
    (None, None, "10.0.0.5", (DOCKER0, ETH0), "10.0.0.5", "the source of this host's default route"),
    # The kernel routes etcd over a virtual interface (a pod's eth0, a VPN): that is where etcd is.
    (None, "10.244.0.2", "10.244.1.7", (POD_ETH0,), "10.244.1.7", "route to etcd at 10.244.0.2"),
    (None, "10.8.0.1", "10.8.0.2", (TUN0, ETH0), "10.8.0.2", "route to etcd at 10.8.0.1"),
    (None, "etcd.example", "2001:db8::5", (V6_ONLY,), "2001:db8::5", "route to etcd at etcd.example"),
    # No route: the first physical one (a bond counts), never a bridge, veth or tun/tap, nor one that is down.
    (None, None, None, (LO, DOCKER0, ETH0, VETH, TUN0), "10.0.0.5", "no default route: the first address on a "
                                                                     "physical interface, eth0"),
    (None, "etcd.example", None, (DOCKER0, ENS_DOWN, BOND0, ETH0), "10.2.0.5",
     "no route to etcd at etcd.example: the first address on a physical interface, bond0"),
    (None, None, None, (LO, DOCKER0, VETH, POD_ETH0, ENS_DOWN), "127.0.0.1",
     "no default route and no physical interface with an address"),
    (None, None, None, (V6_ONLY,), "127.0.0.1", "no default route and no physical interface"),
    (None, None, None, (), "127.0.0.1", "no default route and no physical interface"),
])
def test_the_address_and_why(given, etcd_host, source, interfaces, address, reason):
    advertised = choose_address(given=given, etcd_host=etcd_host, route_source=source, interfaces=interfaces)
    assert advertised.address == address and reason in advertised.reason, advertised
    assert advertised.line() == f"advertising {advertised.address} ({advertised.reason})"


@pytest.mark.parametrize(("name", "facts", "kind"), [
    ("eth0", {"has_device": True}, PHYSICAL),
    ("docker0", {"has_device": False, "bridge": True}, BRIDGE),
    ("br0", {"has_device": False, "bridge": True}, BRIDGE),          # a bridge whatever its name
    ("tap3", {"has_device": False, "tuntap": True}, TUNTAP),
    ("bond0", {"has_device": False, "bond": True}, BOND),
    ("eth0.100", {"has_device": False, "vlan": True}, VLAN),
    ("veth9f3c", {"has_device": False}, CONTAINER),
    ("br-5e1f0a", {"has_device": False}, CONTAINER),
    ("virbr0-nic", {"has_device": False}, CONTAINER),
    ("cni0", {"has_device": False}, CONTAINER),
    ("flannel.1", {"has_device": False}, CONTAINER),
    ("eth0", {"has_device": False}, VIRTUAL),                        # a pod's or a namespace's veth
    ("lo", {"has_device": False, "loopback": True}, LOOPBACK),
])
def test_interface_kind(name, facts, kind):
    assert interface_kind(name, **facts) == kind


def test_which_kinds_a_fallback_skips_and_doctor_warns_about():
    assert not ETH0.virtual and not BOND0.virtual
    assert DOCKER0.virtual and VETH.virtual and TUN0.virtual and POD_ETH0.virtual
    assert DOCKER0.local_only and VETH.local_only and TUN0.local_only
    # A pod's eth0 is its way out: skipped by the fallback, but not worth a warning.
    assert not POD_ETH0.local_only and not ETH0.local_only


HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT"


@pytest.mark.parametrize(("rows", "expected"), [
    (["eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0",
      "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0"], ("eth0", "192.0.2.1")),
    # The lowest metric wins; a route that is down (flags without RTF_UP) does not count.
    (["wlan0\t00000000\t0101A8C0\t0003\t0\t0\t600\t00000000\t0\t0\t0",
      "eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0",
      "eth1\t00000000\t0200000A\t0002\t0\t0\t0\t00000000\t0\t0\t0"], ("eth0", "10.0.0.1")),
    (["eth0\t00000000\t00000000\t0001\t0\t0\t0\t00000000\t0\t0\t0"], ("eth0", "0.0.0.0")),  # straight onto a link
    (["eth0\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0"], None),  # no default route
    (["garbage", "eth0\tzz\t00000000\t0001\t0\t0\t0\t00000000\t0\t0\t0"], None),
    ([], None),
])
def test_default_gateway_from_proc_net_route(rows, expected):
    assert parse_default_gateway("\n".join([HEADER, *rows])) == expected


def test_the_readers_on_this_host():
    # A UDP socket connected to loopback is bound to loopback; a name that does not resolve has no route.
    assert addressing.gather_route_source("127.0.0.1") == "127.0.0.1"
    assert addressing.gather_route_source("no-such-host.invalid") is None
    interfaces = {i.name: i for i in addressing.gather_interfaces()}
    assert interfaces["lo"].loopback and interfaces["lo"].kind == LOOPBACK and interfaces["lo"].up
    assert "127.0.0.1" in interfaces["lo"].addresses
    assert addressing.gather_default_route_source("/no/such/route/file") is None
    # The readers and the rule together: the loopback job reads nothing, a given address wins.
    assert addressing.advertised_address(None, "127.0.0.1").address == "127.0.0.1"
    assert addressing.advertised_address("10.9.9.9", None).address == "10.9.9.9"


def test_the_default_route_read_from_a_file(tmp_path):
    route = tmp_path / "route"
    route.write_text(HEADER + "\nlo\t00000000\t0100007F\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    # A gateway on loopback: the source of the route to it is loopback (no packet is sent).
    assert addressing.gather_default_route_source(str(route)) == "127.0.0.1"
    route.write_text(HEADER + "\n")
    assert addressing.gather_default_route_source(str(route)) is None
