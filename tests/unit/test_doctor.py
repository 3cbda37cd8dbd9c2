"""`elasticctl doctor`: each check's verdicts from a table of facts, then the pass and fail
paths against a real etcd on loopback, and `up`/`join` refusing a host that fails one.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/contract/test_doctor_clock.py, tests/process/test_doctor_cli.py.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticctl import doctor
from elasticctl.doctor import Report, checks, gather
from elasticctl.doctor.checks import (
    AdvertisedFacts,
    Check,
    DateSample,
    EtcdMember,
    Gpu,
    InterfaceFacts,
    RemoteNode,
    Status,
)
from elasticctl.etcd.client import Endpoint
from elasticctl.job.registry import NODE_FIELDS, typed_record


PASS, WARN, FAIL = Status.PASS, Status.WARN, Status.FAIL
GIB = 1 << 30


# -- the pure decisions, from tables ------------------------------------------------------------

@pytest.mark.parametrize(("python", "torch", "status", "needle"), [
    ((3, 11, 7), "2.14.1", PASS, "Python 3.11.7, torch 2.14.1"),
    ((3, 9, 18), "2.14.1", FAIL, "Python 3.9.18 is older than the 3.10"),
    ((3, 12, 0), None, FAIL, "torch is not installed"),
])
def test_versions(python, torch, status, needle):
    check = checks.decide_versions(python, torch)
    assert (check.status, needle in check.detail) == (status, True), check


@pytest.mark.parametrize(("local", "others", "status", "needle"), [
    ("2.14.1", {}, PASS, "no other live node"),
    ("2.14.1", {"a": "2.14.1", "b": "2.14.1"}, PASS, "on 2 other node(s)"),
    ("2.14.1", {"a": "2.14.0"}, WARN, "a has 2.14.0"),
    ("2.14.1+cu124", {"a": "2.14.1+cpu"}, WARN, "a has 2.14.1+cpu"),
    ("2.14.1", {"a": "2.13.0", "b": "2.14.1"}, FAIL, "this host has torch 2.14.1 but a has 2.13.0"),
    # A node of an older elasticctl publishes no version: unknown, not an error.
    ("2.14.1", {"old": None}, PASS, "1 node(s) did not publish theirs (old)"),
    ("2.14.1", {"old": None, "a": "2.14.1"}, PASS, "did not publish theirs (old)"),
    (None, {"a": "2.14.1"}, PASS, "nothing to compare"),
])
def test_torch_agreement(local, others, status, needle):
    check = checks.decide_torch_agreement(local, others)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("args", "status", "needle"), [
    (("2.14.1", None, False, None, True, 0), PASS, "CUDA none (CPU build)"),
    (("2.14.1", "12.4", True, "2.21.5", True, 8), PASS, "NCCL 2.21.5"),
    (("2.14.1", None, False, None, True, 2), FAIL, "but 2 GPU(s) are visible"),
    (("2.14.1", "12.4", False, None, True, 2), FAIL, "CUDA cannot use the 2 visible GPU(s)"),
    (("2.14.1", None, False, None, False, 0), FAIL, "gloo is not available"),
])
def test_torch_build(args, status, needle):
    check = checks.decide_torch_build(*args)
    assert check.status is status and needle in check.detail, check


def test_nvidia_smi_rows_are_parsed_and_junk_is_skipped():
    text = ("0, NVIDIA A100-SXM4-80GB, 41, 1024, 81920, 0\n"
            "1, NVIDIA A100-SXM4-80GB, 93, 0, 81920, [N/A]\n"
            "No devices were found\n")
    assert checks.parse_nvidia_smi(text) == [
        Gpu(0, "NVIDIA A100-SXM4-80GB", 41, 1024, 81920, 0),
        Gpu(1, "NVIDIA A100-SXM4-80GB", 93, 0, 81920, None),
    ]


HEALTHY = Gpu(0, "A100", 40, 0, 81920, 0)


@pytest.mark.parametrize(("gpus", "error", "devices", "peers", "status", "needle"), [
    (None, None, 0, (), PASS, "no GPU: CPU/gloo"),
    ([], None, 0, (), PASS, "no GPU: CPU/gloo"),
    (None, None, 0, ("b",), WARN, "but b have GPUs"),
    (None, None, 2, (), WARN, "2 /dev/nvidia device(s) but no nvidia-smi"),
    (None, "exit code 9: NVIDIA-SMI has failed", 1, (), FAIL, "nvidia-smi failed: exit code 9"),
    ([HEALTHY], None, 1, (), PASS, "1 GPU(s) healthy (0: A100)"),
    ([HEALTHY, Gpu(1, "A100", 40, 0, 81920, 3)], None, 2, (), WARN, "GPU 1 has 3 uncorrected ECC errors"),
    ([Gpu(0, "A100", 95, 0, 81920, None)], None, 1, (), WARN, "GPU 0 is at 95 C"),
])
def test_gpus(gpus, error, devices, peers, status, needle):
    check = checks.decide_gpus(gpus, error, devices, peers)
    assert check.status is status and needle in check.detail, check


OTHER_HOST = RemoteNode("b", "host-b", "10.0.0.2")
LOOPBACK = InterfaceFacts(local_addr="127.0.0.1", interface="lo", addresses=("127.0.0.1", "::1"),
                          loopback=True, available=("eth0", "lo"))
ETH0 = InterfaceFacts(local_addr="10.0.0.1", interface="eth0", addresses=("10.0.0.1",), loopback=False,
                      available=("eth0", "lo"))


@pytest.mark.parametrize(("facts", "status", "needle"), [
    (LOOPBACK, PASS, "loopback, fine while every node runs on this host"),
    (InterfaceFacts(**{**LOOPBACK.__dict__, "remote_nodes": (OTHER_HOST,)}), FAIL,
     "loopback interface lo (127.0.0.1, ::1) while the job has nodes on other hosts: b on host-b (10.0.0.2)"),
    (InterfaceFacts(**{**ETH0.__dict__, "remote_nodes": (OTHER_HOST,)}), PASS, "eth0 (10.0.0.1) holding 10.0.0.1"),
    (InterfaceFacts(**{**ETH0.__dict__, "interface": None, "variable": "GLOO_SOCKET_IFNAME",
                       "requested": "ib0"}), FAIL, "GLOO_SOCKET_IFNAME=ib0 names no interface of this host"),
    (InterfaceFacts(**{**ETH0.__dict__, "variable": "GLOO_SOCKET_IFNAME", "requested": "eth0"}), PASS,
     "from GLOO_SOCKET_IFNAME"),
    (InterfaceFacts(**{**ETH0.__dict__, "nccl_requested": "ib"}), FAIL, "NCCL_SOCKET_IFNAME=ib matches no"),
    (InterfaceFacts(**{**ETH0.__dict__, "interface": None, "addresses": ()}), WARN,
     "the local address 10.0.0.1 is on no interface of this host"),
])
def test_interface(facts, status, needle):
    check = checks.decide_interface(facts)
    assert check.status is status and needle in check.detail, check


ON_ETH0 = AdvertisedFacts(local_addr="10.0.0.5", addresses=("10.0.0.5",), interface="eth0", kind="physical",
                          etcd_endpoint="10.0.0.2:2379", etcd_source="10.0.0.5")
ON_DOCKER0 = AdvertisedFacts(local_addr="172.17.0.1", addresses=("172.17.0.1",), interface="docker0",
                             kind="bridge", local_only=True, etcd_endpoint="10.0.0.2:2379", etcd_source="172.17.0.1")


@pytest.mark.parametrize(("facts", "status", "needles"), [
    (ON_ETH0, PASS, ["advertising 10.0.0.5 on eth0 (physical), the address etcd sees this host connect from"]),
    (dataclasses.replace(ON_ETH0, etcd_source=None, etcd_endpoint=None), PASS, ["advertising 10.0.0.5 on eth0"]),
    # A pod's eth0 (a veth, no device behind it) is its way out: no warning.
    (dataclasses.replace(ON_ETH0, kind="virtual"), PASS, ["on eth0 (virtual)"]),
    (ON_DOCKER0, WARN, ["the advertised address 172.17.0.1 is on docker0, a bridge interface that other hosts "
                        "usually cannot reach"]),
    (dataclasses.replace(ON_ETH0, etcd_source="192.168.1.5"), WARN,
     ["etcd at 10.0.0.2:2379 sees this host connect from 192.168.1.5, not from the advertised 10.0.0.5"]),
    # Both at once: one sentence each, in one warning.
    (dataclasses.replace(ON_DOCKER0, etcd_source="10.0.0.5"), WARN,
     ["is on docker0, a bridge interface", "sees this host connect from 10.0.0.5, not from the advertised 172.17.0.1"]),
    # A name: compared by what it resolves to.
    (dataclasses.replace(ON_ETH0, local_addr="node-a", addresses=("10.0.0.5",)), PASS, ["advertising node-a"]),
    # A loopback job: etcd sees ::1 or 127.0.0.1, either is this host.
    (AdvertisedFacts(local_addr="127.0.0.1", addresses=("127.0.0.1",), interface="lo", kind="loopback",
                     etcd_endpoint="localhost:2379", etcd_source="::1"), PASS, ["advertising 127.0.0.1 on lo"]),
    # An address no interface holds (behind NAT): the interface check speaks of that; etcd's view still counts.
    (AdvertisedFacts(local_addr="203.0.113.7", addresses=("203.0.113.7",), etcd_endpoint="10.0.0.2:2379",
                     etcd_source="10.0.0.5"), WARN, ["connect from 10.0.0.5, not from the advertised 203.0.113.7"]),
])
def test_advertised_address(facts, status, needles):
    check = checks.decide_advertised(facts)
    assert check.status is status and all(n in check.detail for n in needles), check
    assert check.name == "address"
    if status is WARN:
        assert "--local-addr" in check.fix and check.fix.endswith(".")


def test_advertised_facts_from_a_real_connection_on_loopback():
    # Any TCP listener stands for etcd here: what counts is the local end of the connection.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        facts = gather.gather_advertised("127.0.0.1", Endpoint("127.0.0.1", port))
    assert (facts.interface, facts.etcd_source, facts.local_only) == ("lo", "127.0.0.1", False), facts
    assert checks.decide_advertised(facts).status is PASS
    # Nothing listens: the source is unknown (the etcd check reports the failure), no warning.
    facts = gather.gather_advertised("127.0.0.1", Endpoint("127.0.0.1", port))
    assert facts.etcd_source is None and checks.decide_advertised(facts).status is PASS


@pytest.mark.parametrize(("published", "remote"), [
    ("10.0.0.2", True),
    ("127.0.0.1", False),
    ("node-on-this-host", False),   # a name that resolves to loopback here: several nodes on one host
    ("node-elsewhere", True),       # a name that resolves to another host's address
    ("unresolvable", True),
])
def test_interface_facts_count_a_published_name_by_what_it_resolves_to(monkeypatch, published, remote):
    table = {"node-on-this-host": "127.0.0.1", "node-elsewhere": "10.0.0.2", "10.0.0.2": "10.0.0.2",
             "127.0.0.1": "127.0.0.1"}

    def getaddrinfo(host, *_args, **_kwargs):
        if host not in table:
            raise gather.socket.gaierror(f"{host} does not resolve")
        return [(gather.socket.AF_INET, gather.socket.SOCK_STREAM, 6, "", (table[host], 0))]

    monkeypatch.setattr(gather.socket, "getaddrinfo", getaddrinfo)
    facts = gather.gather_interface("127.0.0.1", {"b": {"host": "host-b", "addr": published}}, environ={})
    assert bool(facts.remote_nodes) is remote, facts


@pytest.mark.parametrize(("value", "exact", "chosen"), [
    ("eth0", True, ("eth0",)),
    ("eth", True, ()),
    ("eth0,lo", True, ("eth0", "lo")),
    ("eth", False, ("eth0", "eth1")),
    ("=eth", False, ()),
    ("^docker,lo", False, ("eth0", "eth1")),
])
def test_socket_ifname_values_select_interfaces_as_gloo_and_nccl_do(value, exact, chosen):
    assert gather._interfaces_named(value, ("docker0", "eth0", "eth1", "lo"), exact) == chosen


@pytest.mark.parametrize(("latencies", "error", "status", "needle"), [
    ([0.6, 0.8, 0.7], None, PASS, "median 0.7 ms over 3 reads"),
    ([80.0, 90.0, 1.0], None, WARN, "median 80.0 ms over 3 reads (above 50 ms)"),
    ([], "cannot reach etcd at h:1: no answer", FAIL, "cannot reach etcd at h:1"),
    ([], None, WARN, "etcd not checked"),
])
def test_etcd(latencies, error, status, needle):
    check = checks.decide_etcd("h:1", latencies, error)
    assert check.status is status and needle in check.detail, check


def members(*versions: str | None) -> list[EtcdMember]:
    return [EtcdMember(f"m{i}", v, None if v else "no answer") for i, v in enumerate(versions)]


UPGRADE = "Upgrade the etcd members to 3.5.3 or later."


@pytest.mark.parametrize(("found", "status", "needle"), [
    # One member has no other to disagree with, whatever its version.
    (members("3.5.1"), PASS, "1 member ('m0' 3.5.1): the etcd 3.5.0-3.5.2 data-inconsistency bug needs"),
    (members("3.5.0"), PASS, "1 member ('m0' 3.5.0)"),
    # Several members: any one on 3.5.0, 3.5.1 or 3.5.2 is worth the warning.
    (members("3.5.1", "3.5.1", "3.5.1"), WARN, "3 of the 3 etcd members run 3.5.0-3.5.2 ('m0' 3.5.1, 'm1' 3.5.1"),
    (members("3.5.0", "3.5.4", "3.5.4"), WARN, "1 of the 3 etcd members run 3.5.0-3.5.2"),
    (members("3.5.4", "3.5.2"), WARN, "1 of the 2 etcd members"),
    (members("3.5.2-rc.0", "3.5.21"), WARN, "1 of the 2"),  # a pre-release counts as its release
    # Before and after the bug.
    (members("3.4.23", "3.4.23", "3.4.23"), PASS, "3 members ('m0' 3.4.23, 'm1' 3.4.23, 'm2' 3.4.23)"),
    (members("3.5.3", "3.5.3", "3.5.3"), PASS, "3 members"),
    (members("3.6.0", "3.6.0", "3.5.21"), PASS, "3 members"),
    (members("3.5.10", "3.5.20"), PASS, "2 members"),  # compared as numbers, not as text
    # Unknown or unreadable versions are named, and cannot raise a warning on their own.
    (members("3.5.4", None, "3.5.4"), PASS, "'m1' unknown (no answer)"),
    (members("3.5.4", "３.5.1"), PASS, "'m1' unreadable version '３.5.1'"),
    (members("3.5.1", None), WARN, "'m1' unknown (no answer)"),
    ([EtcdMember("", "3.5.1"), EtcdMember("b", "3.5.1")], WARN, "an unnamed member 3.5.1"),
    ([], PASS, "etcd listed no member"),
])
def test_etcd_members(found, status, needle):
    check = checks.decide_etcd_members(found)
    assert check.name == "etcd-version" and check.status is status and needle in check.detail, check
    assert check.fix == (UPGRADE if status is WARN else "")


def test_etcd_members_unlisted_is_a_warning_saying_why():
    check = checks.decide_etcd_members([], "etcd at h:1 refused to list its members: permission denied")
    assert check.status is WARN and check.detail.endswith("refused to list its members: permission denied")
    assert "member list" in check.fix


@pytest.mark.parametrize(("text", "version"), [
    ("3.5.1", (3, 5, 1)), ("3.4.23", (3, 4, 23)), ("3.6.0-rc.3", (3, 6, 0)), ("3.5.3+git", (3, 5, 3)),
    ("3.5", None), ("v3.5.1", None), (" 3.5.1", None), ("3.5.1\n", None), ("3.5.1-", None), ("3.٥.1", None),
    ("", None), (None, None), (351, None), ("99999.0.0", None),
])
def test_etcd_version_is_read_strictly(text, version):
    assert checks.parse_etcd_version(text) == version


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VERSION_LIKE = st.one_of(st.none(), st.text(max_size=60),
                         st.from_regex(r"[0-9]{1,5}\.[0-9]{1,5}\.[0-9]{1,5}([-+][A-Za-z0-9.]{0,45})?", fullmatch=True))


@FUZZ
@given(st.lists(st.tuples(st.text(max_size=80), VERSION_LIKE, st.none() | st.text(max_size=80)), max_size=6))
def test_fuzz_etcd_members_from_the_network_never_raise_and_warn_only_on_an_affected_member(found):
    """Names and versions come from etcd's member list and each member's status: any text."""
    listed = [EtcdMember(*member) for member in found]
    check = checks.decide_etcd_members(listed)
    assert check.detail.isprintable(), check
    versions = [checks.parse_etcd_version(m.version) for m in listed]
    bad = [v for v in versions if v is not None and (3, 5, 0) <= v <= (3, 5, 2)]
    assert (check.status is WARN) == (len(listed) > 1 and bool(bad)), check


def samples_with_offset(offset: float, start: float = 1_000_000.25, count: int = 6) -> list[DateSample]:
    """What a host whose clock is ``offset`` s behind etcd's would see (1 ms round trips)."""
    found = []
    for i in range(count):
        sent = start + i / count
        found.append(DateSample(sent, sent + 0.001, float(int(sent + 0.0005 + offset))))
    return found


@pytest.mark.parametrize(("offset", "status"), [
    (0.0, PASS), (0.4, PASS), (-0.7, PASS), (2.5, WARN), (-5.0, WARN), (45.0, FAIL), (-3600.0, FAIL),
])
def test_clock_offset_is_bounded_from_date_headers(offset, status):
    low, high = checks.clock_offset_bounds(samples_with_offset(offset))
    assert low <= offset <= high and high - low < 0.25
    assert checks.decide_clock((low, high)).status is status


def test_one_date_sample_reports_only_an_offset_it_is_sure_of():
    # One sample bounds the offset to a second: 1.4 s could be 0.9 s, not enough to warn.
    bounds = checks.clock_offset_bounds(samples_with_offset(1.4, count=1))
    assert bounds[1] - bounds[0] == pytest.approx(1.001)
    assert checks.decide_clock(bounds).status is PASS
    assert checks.decide_clock(checks.clock_offset_bounds(samples_with_offset(-31.5, count=1))).status is FAIL


def test_clock_that_steps_between_samples_trusts_the_last_one():
    stepped = [DateSample(100.0, 100.001, 100.0), DateSample(101.0, 101.001, 160.0)]
    assert checks.clock_offset_bounds(stepped) == pytest.approx((58.999, 60.0))
    check = checks.decide_clock(checks.clock_offset_bounds(stepped))
    assert check.status is FAIL and "leases and record timestamps would lie" in check.detail


def test_clock_unmeasurable_is_a_warning():
    check = checks.decide_clock(None, "Connection refused")
    assert check.status is WARN and "Connection refused" in check.detail


@pytest.mark.parametrize(("total", "free", "status", "needle"), [
    (24 * GIB, 23 * GIB, PASS, "/dev/shm 24.0 GiB, 23.0 GiB free"),
    (64 << 20, 64 << 20, WARN, "DataLoader workers and NCCL need more"),
    (None, None, WARN, "/dev/shm is missing"),
])
def test_shm(total, free, status, needle):
    check = checks.decide_shm(total, free)
    assert check.status is status and needle in check.detail, check


def test_port():
    assert checks.decide_port("0.0.0.0", 4242, None).status is PASS
    check = checks.decide_port("0.0.0.0", None, "Address already in use")
    assert check.status is FAIL and "cannot listen on 0.0.0.0: Address already in use" in check.detail


def test_a_free_port_listens_here():
    assert gather.gather_port("127.0.0.1").status is PASS


@pytest.mark.parametrize(("path", "error", "status", "needle"), [
    (None, None, PASS, "no checkpoint directory given"),
    ("/ckpt", None, PASS, "'/ckpt' is writable"),
    ("/ckpt", "Permission denied", FAIL, "the checkpoint directory '/ckpt' is not writable: Permission denied"),
])
def test_checkpoint_dir(path, error, status, needle):
    check = checks.decide_checkpoint_dir(path, error)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("in_etcd", "in_file", "claimed", "status", "needle"), [
    ("t1", "t1", True, PASS, "first node of job j"),
    ("t1", "t1", False, PASS, "the same directory as the other nodes"),
    ("t1", "t2", False, FAIL, "holds a different marker for job j"),
    ("t1", None, False, FAIL, "holds no marker for job j"),
])
def test_checkpoint_marker(in_etcd, in_file, claimed, status, needle):
    check = checks.decide_checkpoint_marker("/ckpt", "j", in_etcd, in_file, claimed)
    assert check.status is status and needle in check.detail, check


@pytest.mark.parametrize(("named", "jobs", "status", "chosen"), [
    (None, {}, PASS, None),
    (None, {"a": 2}, PASS, "a"),
    (None, {"a": 2, "b": 1}, PASS, None),
    ("b", {"a": 2, "b": 1}, PASS, "b"),
    ("c", {"a": 2}, WARN, None),
])
def test_job(named, jobs, status, chosen):
    check, job = checks.decide_job(named, jobs)
    assert (check.status, job) == (status, chosen)


def test_refusal_is_one_sentence_naming_the_first_failure():
    report = Report((
        Check("shm", WARN, "small", "Grow it."),
        Check("checkpoint-dir", FAIL, "the checkpoint directory '/x' is not writable: Permission denied",
              "Create the directory with write permission for this user."),
        Check("interface", FAIL, "loopback", "Pass --local-addr."),
    ))
    assert doctor.refusal(report, "j") == (
        "This host cannot join job 'j': check checkpoint-dir: the checkpoint directory '/x' is not writable: Permission denied "
        "(and 1 more failed check(s) above); create the directory with write permission for this user.")
    assert doctor.refusal(Report((Check("shm", WARN, "small", "Grow it."),)), "j") is None


def test_check_lines_show_the_fix_only_when_something_is_wrong():
    assert Check("a", PASS, "fine").lines() == ["PASS a: fine"]
    assert Check("b", WARN, "meh", "Do x.").lines() == ["WARN b: meh", "  fix: Do x."]


def test_node_records_keep_the_torch_version_and_older_records_still_read():
    assert typed_record(b'{"id": "a", "torch": "2.14.1"}', NODE_FIELDS) == {"id": "a", "torch": "2.14.1"}
    assert typed_record(b'{"id": "a", "torch": 2}', NODE_FIELDS) == {"id": "a"}


def test_checkpoint_dir_probe_leaves_nothing_behind(tmp_path):
    assert gather.probe_writable(str(tmp_path / "new" / "ckpt")) is None
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []


@pytest.mark.parametrize(("progress", "status", "needle"), [
    (None, PASS, "no failed checkpoint"),
    ({"step": 5}, PASS, "no failed checkpoint"),
    ({"checkpoint_error": "Writing ... failed: the disk is full (No space left on device).",
      "checkpoint_failures": 3}, WARN, "the job's last 3 checkpoint(s) failed: Writing ... failed: the disk is full"),
])
def test_checkpoint_health(progress, status, needle):  # checkpoints on a full disk
    check = checks.decide_checkpoint_health(progress)
    assert check.status is status and needle in check.detail, check
