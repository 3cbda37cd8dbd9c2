"""Bad input meets one sentence: `elasticctl: error: ...` naming the value, a non-zero exit,
no traceback, nothing left in etcd and nothing left running.

Each test runs the real CLI (a subprocess) against a real etcd on loopback, except the
property tests, which call the CLI's entry point in this process.

Layer tests/process: real processes (elasticctl, torchrun, workers, tools). The other tests of this
subject: tests/unit/test_bad_input_values.py.
"""

from __future__ import annotations

import json
import os
import subprocess

import psutil
import pytest
from support.helpers import ELASTICCTL, MLP, REPO

from elasticctl.etcd.client import EtcdClient
from elasticctl.etcd.lease import Lease
from elasticctl.embedded_etcd import free_port
from elasticctl.job.registry import DEFAULT_KEY_PREFIX, Registry
from elasticctl.job.spec import JobSpec


def one_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The single `elasticctl: error:` line of a failed run, which names every needle."""
    assert result.returncode != 0, f"exit 0; stdout: {result.stdout!r}"
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("elasticctl: error: ")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0], result.stderr
    return errors[0]


def run_bounded(*args: str, timeout: float = 30, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    """The real CLI as a subprocess; one that does not stop fails the test instead of hanging it."""
    try:
        return subprocess.run([*ELASTICCTL, *args], check=False, capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        pytest.fail(f"elasticctl {' '.join(args)!r} was still running after {timeout:g} s")


def job_keys(etcd, job: str) -> list[str]:
    with EtcdClient(etcd.client_settings()) as client:
        return [kv.key.decode() for kv in client.get_prefix(f"{DEFAULT_KEY_PREFIX}/{job}/")]


def processes_mentioning(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


@pytest.fixture
def client(default_etcd):
    with EtcdClient(default_etcd.client_settings()) as etcd_client:
        yield etcd_client


@pytest.fixture
def published(default_etcd, client, run_id):
    """A published job named ``run_id`` (no node): what `status` and `leave` look at."""
    registry = Registry(client, run_id)
    registry.publish_spec(JobSpec(name=run_id, script=MLP))
    yield registry
    registry.delete_job()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["up", "--dry-run", "--nnodes", "1", "--job", "abc\n", MLP], r"The job name 'abc\n'"),
        (["up", "--dry-run", "--nnodes", "1", "--node-id", "a/b", MLP], "The node id 'a/b'"),
        (["join", "--job", "abc\n"], r"The job name 'abc\n'"),
        (["join", "--node-id", "a b"], "The node id 'a b'"),
        (["status", "--job", "abc\n"], r"The job name 'abc\n'"),
        (["leave", "--job", "abc\n"], r"The job name 'abc\n'"),
        (["leave", "--node", "a/b"], "The node id 'a/b'"),
        (["down", "--job", "-x"], "The job name '-x'"),
    ],
    ids=["up-job", "up-node-id", "join-job", "join-node-id", "status-job", "leave-job",
         "leave-node", "down-job"],
)
def test_every_command_applies_the_naming_rule(default_etcd, args, needle):
    result = run_bounded(args[0], "--etcd", default_etcd.endpoint, *args[1:])
    one_error(result, needle, "must be 1-63 letters")


def test_up_with_a_bad_node_id_publishes_nothing(default_etcd, run_id):
    result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--node-id", "a/b",
                         "--nnodes", "1", MLP, "--steps", "1", timeout=120)
    one_error(result, "The node id 'a/b'")
    assert job_keys(default_etcd, run_id) == []
    assert processes_mentioning(run_id) == []


# -- 12: leave --node with a '/' writes nothing ----------------------------------------------------

def test_leave_with_a_bad_node_id_writes_nothing(default_etcd, client, published, run_id):
    lease = Lease(client, 5).start()
    try:
        # A node record 'a/b', as an elasticctl that did not check ids yet wrote it.
        client.put(published.keys.node("a/b"), json.dumps({"host": "elsewhere", "id": "a/b"}),
                   lease=lease.id())
        result = run_bounded("leave", "--etcd", default_etcd.endpoint, "--job", run_id,
                             "--node", "a/b", "--no-wait")
        one_error(result, "The node id 'a/b'")
        assert [k for k in job_keys(default_etcd, run_id) if "/control/" in k] == []
    finally:
        lease.stop(revoke=True)


# -- 6: ports and data directories of the embedded etcd --------------------------------------------

@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["etcd", "--client-port", "99999"], "99999"),
        (["etcd", "--peer-port", "-1"], "-1"),
        (["up", "--dry-run", "--nnodes", "1", "--etcd-port", "99999", MLP], "99999"),
        (["up", "--dry-run", "--nnodes", "1", "--etcd-peer-port", "65536", MLP], "65536"),
    ],
    ids=["etcd-client", "etcd-peer", "up-client", "up-peer"],
)
def test_port_out_of_range_is_one_sentence(args, needle):
    one_error(run_bounded(*args), needle, "is not in the range 0<=x<=65535")


def _embedded_etcd_args(command: str, data_dir: str, port: int, peer: int) -> list[str]:
    if command == "etcd":
        return ["etcd", "--listen", "127.0.0.1", "--client-port", str(port),
                "--peer-port", str(peer), "--data-dir", data_dir]
    return ["up", "--etcd-listen", "127.0.0.1", "--etcd-port", str(port),
            "--etcd-peer-port", str(peer), "--etcd-data-dir", data_dir, "--nnodes", "1", MLP,
            "--steps", "1"]


@pytest.mark.parametrize("command", ["etcd", "up"])
@pytest.mark.parametrize("kind", ["under-proc", "a-file", "under-a-file"])
def test_unusable_data_dir_is_one_sentence_and_starts_nothing(tmp_path, command, kind):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    data_dir = {"under-proc": f"/proc/elasticctl-{tmp_path.name}", "a-file": str(a_file),
                "under-a-file": str(a_file / "data")}[kind]
    port, peer = free_port(), free_port()
    result = run_bounded(*_embedded_etcd_args(command, data_dir, port, peer), timeout=120)
    one_error(result, f"'{data_dir}'")
    assert not listening(port) and not listening(peer)
    assert processes_mentioning(data_dir) == []


def test_equal_client_and_peer_ports_are_refused():
    port = free_port()
    result = run_bounded("etcd", "--listen", "127.0.0.1", "--client-port", str(port),
                         "--peer-port", str(port))
    one_error(result, f"must differ (both are {port})")


def test_port_zero_picks_a_free_port_for_up(tmp_path):
    result = run_bounded("up", "--dry-run", "--etcd-listen", "127.0.0.1", "--etcd-port", "0",
                         "--etcd-peer-port", "0", "--nnodes", "1", MLP)
    assert result.returncode == 0, result.stderr
    endpoint = next(a for a in result.stdout.split() if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:") and not endpoint.endswith(":0")


# -- 7: the listen address -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args",
    [
        ["etcd", "--client-port", "0", "--peer-port", "0", "--listen"],
        ["up", "--dry-run", "--nnodes", "1", "--etcd-listen"],
    ],
    ids=["etcd", "up"],
)
@pytest.mark.parametrize("address", ["999.1.1.1", "etcd.example.com"])
def test_listen_address_that_is_no_ip_address_is_named(args, address):
    result = run_bounded(*args, address, MLP) if args[0] == "up" else run_bounded(*args, address)
    line = one_error(result, f"The etcd listen address '{address}' is not an IP address")
    assert "already in use" not in line


def test_listen_address_of_another_host_is_named():
    address = "203.0.113.77"  # TEST-NET-3: no host has it
    if any(a.address == address for addrs in psutil.net_if_addrs().values() for a in addrs):
        pytest.skip(f"this host has {address}")
    result = run_bounded("etcd", "--listen", address, "--client-port", str(free_port()),
                         "--peer-port", str(free_port()))
    line = one_error(result, f"The etcd listen address '{address}' is not an address of this host")
    assert "already in use" not in line


# -- 8: status --watch --interval ------------------------------------------------------------------

@pytest.mark.parametrize("interval", ["-1", "0", "nan"])
def test_status_watch_interval_must_be_sensible(default_etcd, published, run_id, interval):
    result = run_bounded("status", "--etcd", default_etcd.endpoint, "--job", run_id, "--watch",
                         "--interval", interval, timeout=20)
    one_error(result, "'--interval'")


# -- 9: job files are untrusted input --------------------------------------------------------------

@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (b"args: 5\n", ["the key 'args'", "must be a list of arguments", "not the number 5"]),
        (b"args: abc\n", ["the key 'args'", "not the string 'abc'"]),
        (b"args: [--steps, [1, 2]]\n", ["the key 'args'", "not a list"]),
        (b"\x00\xff\xfe", ["is not UTF-8 text (byte 0xff at offset 1)"]),
        (b"env: {A: [1, 2]}\n", ["the key 'env'", "'A' maps to a list"]),
        (b"rdzv_conf: {join_timeout: '5,secret=x'}\n", ["the key 'rdzv_conf'", "'join_timeout'"]),
        (b"legacy-local-rank: 5\n", ["the key 'legacy-local-rank'", "must be true or false"]),
        (b"nnodes: {min: 1}\n", ["the key 'nnodes'", "must be a single value, not a mapping"]),
        (b"args: [a\n", ["is not valid YAML", "line 2"]),
    ],
    ids=["args-number", "args-string", "args-nested", "not-utf8", "env-list", "rdzv-comma",
         "flag-number", "nnodes-mapping", "bad-yaml"],
)
def test_job_file_values_are_checked(tmp_path, content, needles):
    config = tmp_path / "job.yaml"
    config.write_bytes(content)
    result = run_bounded("up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1", "--config",
                         str(config), MLP)
    one_error(result, f"'{config}'", *needles)


@pytest.mark.parametrize("ttl", ["99999999999999999999", "9999999999", "3601", "1"])
def test_node_ttl_out_of_range_is_one_sentence_and_publishes_nothing(default_etcd, run_id, ttl):
    result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                         "--node-ttl", ttl, MLP, "--steps", "1", timeout=120)
    one_error(result, f"({ttl} s)", "between 2 and 3600 seconds")
    assert job_keys(default_etcd, run_id) == []
    assert processes_mentioning(run_id) == []


def test_up_that_fails_after_publishing_withdraws_its_spec(default_etcd, run_id):
    # One GPU visible and two processes asked for: refused when the node prepares its
    # torchrun, after `up` has published the spec.
    # (The GPU is pretended: its admission check, a matmul on it, is skipped.)
    result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                         "--nproc-per-node", "2", "--skip-check", "devices", MLP, "--steps", "1", timeout=120,
                         env={"CUDA_VISIBLE_DEVICES": "0"})
    one_error(result, "processes per node (2) exceed the 1 GPUs")
    assert f"published job {run_id}" in result.stderr
    assert job_keys(default_etcd, run_id) == []
    assert processes_mentioning(run_id) == []


def test_up_that_fails_keeps_a_spec_it_did_not_publish(default_etcd, client, run_id):
    registry = Registry(client, run_id)
    spec = JobSpec(name=run_id, script=MLP, script_args=("--steps", "1"), nproc_per_node="2")
    registry.publish_spec(spec)
    lease = Lease(client, 5).start()
    try:
        registry.register_node({"host": "elsewhere"}, lease.id(), "other")
        result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id,
                             "--nnodes", "1", "--nproc-per-node", "2", "--skip-check", "devices", MLP,
                             "--steps", "1", timeout=120, env={"CUDA_VISIBLE_DEVICES": "0"})
        one_error(result, "processes per node (2) exceed the 1 GPUs")
        assert "already runs with this spec" in result.stderr
        assert JobSpec.from_dict(json.loads(client.get(registry.keys.spec).value)) == spec
        assert set(registry.live_nodes()) == {"other"}
    finally:
        lease.stop(revoke=True)
        registry.delete_job()


# -- the newer flags: every value is checked before anything is published -------------------------

@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--spares", ""], "Invalid value for '--spares': it is empty"),
        (["--evict-stragglers", ""], "Invalid value for '--evict-stragglers': it is empty"),
        (["--straggler-ratio", "1_5"], "straggler_ratio (--straggler-ratio) ('1_5') must be a ratio"),
        (["--straggler-ratio", "１.５"], "straggler_ratio (--straggler-ratio) ('１.５') must be a ratio"),
        (["--evict-stragglers", "３"], "evict_stragglers (--evict-stragglers) ('３') must be a ratio"),
        (["--spares", "1_0"], "spares (--spares) ('1_0') must be a whole number"),
        (["--rdzv-conf", "spares="], "The rendezvous option 'spares' is empty"),
    ],
    ids=["spares-empty", "evict-empty", "ratio-underscore", "ratio-full-width", "evict-full-width",
         "spares-underscore", "rdzv-conf-empty"],
)
def test_a_bad_value_of_a_newer_flag_is_one_sentence_and_publishes_nothing(default_etcd, client, run_id,
                                                                            args, needle):
    result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1", *args,
                         MLP, "--steps", "1", timeout=120)
    one_error(result, needle)
    assert "published job" not in result.stderr
    assert client.get(Registry(client, run_id).keys.spec) is None
    assert job_keys(default_etcd, run_id) == []
    assert processes_mentioning(run_id) == []


# -- a script that refuses its own arguments is not restarted --------------------------------------

LM = str(REPO / "trainers" / "lm.py")


@pytest.mark.parametrize(
    ("recovery", "script_args", "script_error"),
    [
        ("restart", ["--peer-copies", "-1"], "lm.py: error: --peer-copies (-1) must be 0"),
        ("hot", ["--shard", "hsdp", "--peer-copies", "5"], "lm.py: error: --peer-copies needs --shard fsdp"),
    ],
    ids=["restart-negative-copies", "hot-copies-without-fsdp"],
)
def test_a_script_that_refuses_its_arguments_stops_its_node_on_the_first_start(
        default_etcd, client, run_id, recovery, script_args, script_error):
    # Before, its workers were started again through the restart budget and a quarantine,
    # printing the usage each time: a restart runs the same arguments.
    result = run_bounded("up", "--etcd", default_etcd.endpoint, "--job", run_id, "--nnodes", "1",
                         "--recovery", recovery, LM, *script_args, timeout=240)
    try:
        assert result.returncode != 0, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert result.stderr.count("usage: lm.py") == 1, result.stderr
        assert result.stderr.count(script_error) == 1, result.stderr
        assert "quarantine" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("elasticctl: node ") and "stopped: its script" in last, result.stderr
        assert f"{LM} refused its arguments (exit status 2 before it joined the job)" in last, last
        assert processes_mentioning(run_id) == []
    finally:
        Registry(client, run_id).delete_job()


# -- security: a warning when etcd is reachable by anyone ------------------------------------------

_WARNING = "elasticctl: warning: etcd at {} is reached without TLS or authentication"


@pytest.mark.parametrize(
    ("args", "exposed"),
    [
        (["--etcd", "10.0.0.1:2379"], "10.0.0.1:2379"),
        (["--etcd", "127.0.0.1:2379,10.0.0.2:2379"], "10.0.0.2:2379"),
        ([], "0.0.0.0:2379"),  # the embedded etcd listens on every interface by default
        (["--etcd-listen", "0.0.0.0", "--etcd-port", "2479"], "0.0.0.0:2479"),
        (["--etcd", "10.0.0.1:2379", "--etcd-cacert", "ca.pem"], None),
        (["--etcd", "https://10.0.0.1:2379"], None),
        (["--etcd", "10.0.0.1:2379", "--etcd-user", "trainer"], None),
        (["--etcd", "127.0.0.1:2379"], None),
        (["--etcd-listen", "127.0.0.1"], None),
    ],
    ids=["remote", "one-remote", "embedded-default", "embedded-all", "tls", "https", "auth",
         "loopback", "embedded-loopback"],
)
def test_up_warns_once_when_etcd_is_open_to_the_network(args, exposed):
    result = run_bounded("up", "--dry-run", "--nnodes", "1", *args, MLP,
                         env={"ELASTICCTL_ETCD_PASSWORD": "secret"})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines()
                if line.startswith("elasticctl: warning: ")]
    if exposed is None:
        assert warnings == []
    else:
        assert len(warnings) == 1, result.stderr
        assert warnings[0].startswith(_WARNING.format(exposed)), result.stderr
        assert "SECURITY.md" in warnings[0]


def test_join_warns_when_etcd_is_open_to_the_network():
    from elasticctl.launcher import primary_address

    address = primary_address()
    if address.startswith("127."):
        pytest.skip("this host has no address but loopback")
    # This host's own address (no packet leaves it), a port where nothing listens: the
    # warning comes first, then the one-sentence error.
    endpoint = f"{address}:{free_port(address)}"
    result = run_bounded("join", "--dry-run", "--etcd", endpoint, timeout=60)
    one_error(result, endpoint)
    assert result.stderr.splitlines()[0].startswith(_WARNING.format(endpoint)), result.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dashboard", "--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:²"], "'127.0.0.1:²'"),
        (["dashboard", "--etcd", "127.0.0.1:1", "--listen", "127.0.0.1:٨٠٨٠"], "'127.0.0.1:٨٠٨٠'"),
        (["up", "--dry-run", "--nnodes", "²", MLP], "'²'"),
        (["up", "--dry-run", "--nnodes", "1:٢", MLP], "'1:٢'"),
        (["up", "--dry-run", "--nnodes", "1", "--nproc-per-node", "²", MLP], "'²'"),
        (["up", "--dry-run", "--nnodes", "1", "--nproc-per-node", "٢", MLP], "'٢'"),
        (["status", "--etcd", "127.0.0.1:٢٣٧٩"], "'127.0.0.1:٢٣٧٩'"),
        (["status", "--etcd", "127.0.0.1:²"], "'127.0.0.1:²'"),
        (["up", "--dry-run", "--nnodes", "1", "--etcd-port", "٢٣٧٩", MLP], "'٢٣٧٩'"),
        (["etcd", "--client-port", "٢٣٧٩"], "'٢٣٧٩'"),
        (["up", "--dry-run", "--nnodes", "1", "--max-restarts", "٣", MLP], "'٣'"),
        (["up", "--dry-run", "--nnodes", "1", "--node-ttl", "٥", MLP], "'٥'"),
    ],
    ids=["listen-superscript", "listen-arabic-indic", "nnodes-superscript", "nnodes-arabic-indic",
         "nproc-superscript", "nproc-arabic-indic", "etcd-arabic-indic", "etcd-superscript",
         "etcd-port-arabic-indic", "client-port-arabic-indic", "max-restarts-arabic-indic",
         "node-ttl-arabic-indic"],
)
def test_a_number_in_another_script_is_one_sentence(args, needle):
    result = run_bounded(*args)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
