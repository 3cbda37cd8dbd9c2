"""The address this node advertises to the others, and why: torchrun's ``--local-addr``, the
embedded etcd's client URL and the ``join`` line it prints.

The kernel already knows which of this host's addresses the other hosts see: the source
address of its route towards them. So the address is the source of the route to etcd (the
one host every node reaches), or of the default route when etcd runs in this process. The
first address in the order of interface names, the old rule, picked ``docker0``'s 172.17.0.1
over ``eth0`` on any host with Docker.

:func:`choose_address` is the rule, pure and table-tested; the ``gather_*`` functions read
the host (psutil, ``/sys/class/net``, ``/proc/net/route``, a connected UDP socket, which
sends nothing) and :func:`advertised_address` puts the two together.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence

import psutil

# Kinds of interfaces, from what sysfs says of them (and their names, where it says nothing).
PHYSICAL = "physical"
LOOPBACK = "loopback"
BOND = "bond"          # virtual in sysfs, but stacked on physical NICs: often a server's uplink
VLAN = "vlan"          # likewise
BRIDGE = "bridge"
TUNTAP = "tun/tap"
CONTAINER = "container or VM"  # named as container runtimes, hypervisors and overlays name theirs
VIRTUAL = "virtual"    # no device behind it and nothing more known (a pod's or a namespace's veth eth0)

# Names container runtimes, hypervisors and overlay networks give the interfaces they create.
CONTAINER_PREFIXES = ("docker", "br-", "virbr", "cni", "flannel", "veth", "vnet", "podman", "lxcbr", "lxdbr",
                      "cali", "weave", "vxlan", "kube-", "vboxnet", "vmnet", "tun", "tap")
# The uplink-like kinds a fallback may pick: a real NIC, or one stacked straight on real NICs.
_FALLBACK_KINDS = (PHYSICAL, BOND, VLAN)
# Kinds whose address other hosts usually cannot reach: doctor warns when one is advertised.
LOCAL_ONLY_KINDS = (BRIDGE, TUNTAP, CONTAINER)


def is_loopback(host: str) -> bool:
    """``host`` is this host's loopback (a name or an address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def interface_kind(name: str, *, has_device: bool, loopback: bool = False, bridge: bool = False,
                   tuntap: bool = False, bond: bool = False, vlan: bool = False) -> str:
    """What sort of interface ``name`` is: loopback, then what sysfs shows (a bridge, a tun/tap,
    a device behind it), then a bond or VLAN, then what its name says."""
    if loopback:
        return LOOPBACK
    if bridge:
        return BRIDGE
    if tuntap:
        return TUNTAP
    if has_device:
        return PHYSICAL
    if bond:
        return BOND
    if vlan:
        return VLAN
    if name.startswith(CONTAINER_PREFIXES):
        return CONTAINER
    return VIRTUAL


@dataclasses.dataclass(frozen=True)
class NetInterface:
    name: str
    up: bool
    addresses: tuple[str, ...]  # IPv4 and IPv6, scope suffixes removed
    kind: str = PHYSICAL
    loopback: bool = False

    @property
    def virtual(self) -> bool:
        return self.kind not in _FALLBACK_KINDS

    @property
    def local_only(self) -> bool:
        return self.kind in LOCAL_ONLY_KINDS


@dataclasses.dataclass(frozen=True)
class Advertised:
    """The address to advertise and the phrase that says why."""

    address: str
    reason: str

    def line(self) -> str:
        return f"advertising {self.address} ({self.reason})"


def _ipv4(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv4Address)
    except ValueError:
        return False


def choose_address(*, given: str | None, etcd_host: str | None, route_source: str | None,
                   interfaces: Sequence[NetInterface]) -> Advertised:
    """The address other nodes should use for this one.

    ``given``: ``--local-addr``, which always wins. ``etcd_host``: the job's etcd as the user
    named it, None when etcd runs in this process (then the route that counts is the default
    route). ``route_source``: this host's source address on that route, None when there is no
    such route (or etcd's name does not resolve). Without a route, the first IPv4 address (in
    the order of interface names) on an interface that is up and physical (or a bond or VLAN):
    never a bridge, a veth, a tun/tap or another virtual one. Without that either, loopback.
    """
    if given:
        return Advertised(given, "given with --local-addr")
    if etcd_host is not None and is_loopback(etcd_host):
        return Advertised("127.0.0.1", f"etcd at {etcd_host} is on loopback, so every node runs on this host")
    route = f"route to etcd at {etcd_host}" if etcd_host is not None else "default route"
    if route_source is not None and is_loopback(route_source):
        # etcd's name resolves to this host's loopback (Debian's 127.0.1.1): a one-host job.
        return Advertised("127.0.0.1", f"this host's {route} goes over loopback, so every node runs on this host")
    if route_source is not None:
        return Advertised(route_source, f"the source of this host's {route}")
    for interface in sorted(interfaces, key=lambda i: i.name):
        if not interface.up or interface.loopback or interface.virtual:
            continue
        for address in interface.addresses:
            if _ipv4(address) and not is_loopback(address):
                return Advertised(address, f"no {route}: the first address on a physical interface, {interface.name}")
    return Advertised("127.0.0.1", f"no {route} and no physical interface with an address")


def parse_default_gateway(route_table: str) -> tuple[str, str] | None:
    """(interface, gateway) of the IPv4 default route in ``/proc/net/route``'s text (the lowest
    metric among those that are up), gateway ``0.0.0.0`` for a route straight onto a link;
    None without a default route."""
    best: tuple[int, str, str] | None = None
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        name, destination, gateway, flags, metric, mask = fields[0], fields[1], fields[2], fields[3], fields[6], fields[7]
        try:
            up = int(flags, 16) & 0x1  # RTF_UP
            default = int(destination, 16) == 0 and int(mask, 16) == 0
            value = int(metric)
            address = socket.inet_ntoa(struct.pack("<I", int(gateway, 16)))  # stored little-endian
        except (ValueError, struct.error):
            continue
        if up and default and (best is None or value < best[0]):
            best = (value, name, address)
    return None if best is None else (best[1], best[2])


# -- I/O ----------------------------------------------------------------------------------------

def _sys_net(name: str, *parts: str) -> str:
    return os.path.join("/sys/class/net", name, *parts)


def gather_interfaces() -> tuple[NetInterface, ...]:
    """This host's interfaces, their state, addresses and kind (from psutil and sysfs)."""
    stats = psutil.net_if_stats()
    found = []
    for name, entries in psutil.net_if_addrs().items():
        addresses = tuple(a.address.split("%")[0] for a in entries if a.family in (socket.AF_INET, socket.AF_INET6))
        stat = stats.get(name)
        loopback = "loopback" in getattr(stat, "flags", "").split(",") or (
            bool(addresses) and all(is_loopback(a) for a in addresses))
        kind = interface_kind(
            name,
            has_device=os.path.exists(_sys_net(name, "device")),
            loopback=loopback,
            bridge=os.path.isdir(_sys_net(name, "bridge")),
            tuntap=os.path.exists(_sys_net(name, "tun_flags")),
            bond=os.path.isdir(_sys_net(name, "bonding")),
            vlan=os.path.exists(os.path.join("/proc/net/vlan", name)),
        )
        found.append(NetInterface(name, bool(stat and stat.isup), addresses, kind, loopback))
    return tuple(sorted(found, key=lambda i: i.name))


def gather_route_source(host: str) -> str | None:
    """This host's source address on its route to ``host``: what a UDP socket connected there
    is bound to (connecting a UDP socket only looks the route up; nothing is sent). None when
    ``host`` does not resolve or no route leads there."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0].split("%")[0]
    except (OSError, UnicodeError, IndexError):
        return None


def gather_default_route_source(route_file: str = "/proc/net/route") -> str | None:
    """The source address of this host's IPv4 default route, None without one."""
    try:
        with open(route_file, encoding="ascii", errors="replace") as f:
            default = parse_default_gateway(f.read())
    except OSError:
        return None
    if default is None:
        return None
    name, gateway = default
    if gateway != "0.0.0.0":
        return gather_route_source(gateway)
    # A default route straight onto a link (no gateway): its interface's first IPv4 address.
    return next((a.address for a in psutil.net_if_addrs().get(name, ()) if a.family == socket.AF_INET), None)


def advertised_address(given: str | None, etcd_host: str | None) -> Advertised:
    """What this node advertises and why (see :func:`choose_address`): ``etcd_host`` None for
    an etcd in this process. Reads the host only where the rule needs it."""
    if given or (etcd_host is not None and is_loopback(etcd_host)):
        return choose_address(given=given, etcd_host=etcd_host, route_source=None, interfaces=())
    source = gather_route_source(etcd_host) if etcd_host is not None else gather_default_route_source()
    return choose_address(given=given, etcd_host=etcd_host, route_source=source,
                          interfaces=gather_interfaces() if source is None else ())
