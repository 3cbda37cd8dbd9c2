"""Process helpers for tests: start real torchrun/elasticctl nodes, wait on records, clean up.

The nodes, the record and the rule for a world reached are the harness the benchmarks use too
(:mod:`bench.harness`); here its waits fail the test, naming what they waited for."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench import harness
from bench.harness import Node, stop_nodes, trained_together  # noqa: F401 - the tests' names for them

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "trainers" / "mlp.py")
WORKERS = Path(__file__).resolve().parent / "workers"  # scripts the tests run by path
ELASTICCTL = [sys.executable, "-m", "elasticctl.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTICCTL, *args], check=False, capture_output=True, text=True, timeout=timeout)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    result = harness.wait_for(predicate, timeout, interval)
    if not result:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return result


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return records


def torchrun_command(endpoint: str, run_id: str, nnodes: str, script_args: list[str],
                     rdzv_conf: str = "", max_restarts: int = 3) -> list[str]:
    conf = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
    if rdzv_conf:
        conf += "," + rdzv_conf
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.5", "--local-addr=127.0.0.1",
        MLP, *script_args,
    ]


def write_tls_material(directory: Path) -> None:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, key, cert):
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test-ca")).issuer_name(name("test-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca_key, ca)
    for stem, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(stem)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if stem == "server":
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        write(stem, key, builder.sign(ca_key, hashes.SHA256()))


def start_tls_etcd(directory: Path):
    """An etcd that requires TLS client certificates; returns (server, client TLS options)."""
    from elasticctl.embedded_etcd import EmbeddedEtcd, free_port

    write_tls_material(directory)
    tls = {"cacert": str(directory / "ca.pem"), "cert": str(directory / "client.pem"),
           "key": str(directory / "client.key")}
    server = EmbeddedEtcd(data_dir=str(directory / "data"), client_port=free_port(), peer_port=free_port(),
                          cert_file=str(directory / "server.pem"), key_file=str(directory / "server.key"),
                          client_ca_file=str(directory / "ca.pem"))
    server.start(client_settings=server.client_settings(**tls))
    return server, tls


def up_dry_run_in_process(*flags: str) -> tuple[int, str, str]:
    """``elasticctl up --dry-run`` of a 2:3 job of trainers/mlp.py with ``flags``, in this process
    (no subprocess: the unit tests of the flags run it many times): (status, stdout, stderr)."""
    import contextlib
    import io

    from elasticctl.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            main(["up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "2:3", *flags, MLP])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, stdout.getvalue(), stderr.getvalue()


def etcd_metric(etcd, pattern: str) -> float:
    """The value of the one sample of ``etcd``'s /metrics (an EmbeddedEtcd) that ``pattern``
    (a regular expression of the sample's name and labels) names."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE).group(1))
