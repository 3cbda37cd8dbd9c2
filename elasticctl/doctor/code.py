"""The code a node would run, as digests: the training script's file, and the files ``up
--code-hash`` names. ``up`` records them in the job spec; every node that joins hashes its own
files and compares (the ``code`` admission check), so a host with other code never trains.

No torch import, and a module script (``-m``) is located without importing it (nor its parent
packages): the CLI stays fast and runs no user code. Bounded: at most :data:`MAX_CODE_FILES`
files and :data:`MAX_CODE_BYTES` bytes, so that the check stays within the admission budget.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import re
import stat
import sys
from collections.abc import Iterable, Sequence

from elasticctl.errors import ConfigError

SHA256_RE = re.compile(r"[0-9a-f]{64}")
# A digest shown in a sentence: its first 12 hex digits (as git shows commits).
SHOWN_DIGITS = 12
# Hashing a GiB takes about a second; more than this is not the code of a trainer.
MAX_CODE_FILES = 20_000
MAX_CODE_BYTES = 256 << 20
# Never part of the code: bytecode caches differ between hosts that run the same sources.
SKIPPED_DIRS = frozenset({"__pycache__", ".git"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
_CHUNK = 1 << 20


def shown(digest: str) -> str:
    return digest[:SHOWN_DIGITS]


def is_sha256(value: object) -> bool:
    """A digest as the spec keeps it: 64 lowercase hex digits (text from etcd is untrusted)."""
    return isinstance(value, str) and SHA256_RE.fullmatch(value) is not None


def _file_digest(path: str) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.digest()


def hash_file(path: str) -> str:
    """The sha256 of the file at ``path`` (hex); OSError if it cannot be read."""
    return _file_digest(path).hex()


def _skipped(name: str) -> bool:
    return name.endswith(SKIPPED_SUFFIXES)


def code_files(paths: Sequence[str]) -> list[tuple[str, str]]:
    """Every file of ``paths`` (files, or directories walked without following links to
    directories), as (relative name, path) sorted by name: the name is the path as given,
    normalised, with '/' separators, then the file's place under it. ``__pycache__``, ``.git``
    and ``*.pyc`` are left out. A path that does not exist, or too many files: ConfigError."""
    found: dict[str, str] = {}

    def add(name: str, path: str) -> None:
        found[name] = path
        if len(found) > MAX_CODE_FILES:
            raise ConfigError(f"The code to hash has more than {MAX_CODE_FILES} files; name fewer paths "
                              "with --code-hash.")

    for given in paths:
        base = os.path.normpath(given).replace(os.sep, "/")
        if os.path.isfile(given):
            add(base, given)
        elif os.path.isdir(given):
            for root, dirs, files in os.walk(given):
                dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
                for name in files:
                    if _skipped(name):
                        continue
                    path = os.path.join(root, name)
                    if not os.path.isfile(path):  # a dangling link, a socket, a fifo
                        continue
                    rel = os.path.relpath(path, given).replace(os.sep, "/")
                    add(f"{base}/{rel}" if base != "." else rel, path)
        else:
            raise ConfigError(f"The code path '{given}' does not exist on this host.")
    return sorted(found.items())


def hash_code(paths: Sequence[str]) -> str:
    """One sha256 (hex) over the files of ``paths`` (:func:`code_files`): each file's name, size
    and digest in the order of the names, so it is the same on every host with the same files
    whatever order the file system lists them in, and a renamed or changed file changes it."""
    total = 0
    digest = hashlib.sha256(b"elasticctl-code-v1\0")
    for name, path in code_files(paths):
        size = os.stat(path).st_size
        total += size
        if total > MAX_CODE_BYTES:
            raise ConfigError(f"The code to hash is larger than {MAX_CODE_BYTES >> 20} MiB; name fewer "
                              "paths with --code-hash.")
        encoded = name.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(4, "big") + encoded + size.to_bytes(8, "big") + _file_digest(path))
    return digest.hexdigest()


def module_file(name: str, search: Iterable[str] | None = None) -> str:
    """The file ``python -m name`` would run on this host, found without importing anything:
    each package of a dotted name is looked up in its parent's directories (importlib's
    ``find_spec`` would import the parents). ``search``: where a top-level name is looked up
    (default: the working directory, as ``python -m`` puts it first, then ``sys.path``).
    ConfigError when it is not found or is not a file (a built-in or frozen module)."""
    path = list(search) if search is not None else [os.getcwd(), *sys.path]
    spec = None
    for part in name.split("."):
        if not part.isidentifier():
            raise ConfigError(f"The module name '{name}' is not a Python module name.")
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            raise ConfigError(f"The module '{name}' is not found on this host.")
        path = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:  # a package: python -m runs __main__
        for directory in spec.submodule_search_locations:
            main = os.path.join(directory, "__main__.py")
            if os.path.isfile(main):
                return main
        raise ConfigError(f"The package '{name}' has no __main__.py on this host.")
    origin = spec.origin if spec is not None else None
    if not origin or not spec.has_location or not os.path.isfile(origin):
        raise ConfigError(f"The module '{name}' is not a file on this host: its code cannot be hashed.")
    return origin


def script_file(script: str, module: bool) -> str:
    """The file of the job's script on this host (``module``: ``script`` is a module name)."""
    if module:
        return module_file(script)
    mode = os.stat(script).st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"The training script '{script}' is not a file on this host.")
    return script
