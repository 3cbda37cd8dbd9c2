"""The guide's dashboard screenshot (docs/dashboard.png) and what keeps it from going stale.

The browser test takes it from a live job and stamps it with a fingerprint of the page it shows
(the dashboard's static files): a PNG text chunk, which image viewers ignore. A unit test compares
the committed screenshot's stamp with the page as it is now, so a change to the page that did not
bring a new screenshot fails the suite, naming the command that takes one."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
PAGE = ROOT / "elasticctl" / "dashboard" / "static"
STAMP_KEY = b"elasticctl-dashboard-page"
REFRESH = "bash scripts/test tests/process/test_dashboard_browser.py -k live_job"
_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def page_fingerprint(page: Path = PAGE) -> str:
    """The sha256 of the dashboard's static files (name and content, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(page.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    if not png.startswith(_SIGNATURE):
        raise ValueError("not a PNG file")
    chunks, at = [], len(_SIGNATURE)
    while at + 8 <= len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        chunks.append((kind, png[at + 8:at + 8 + length]))
        at += 12 + length
    return chunks


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def stamp(png: bytes, fingerprint: str) -> bytes:
    """``png`` with its page stamp set to ``fingerprint`` (a tEXt chunk before IEND)."""
    kept = [(kind, data) for kind, data in _chunks(png)
            if not (kind == b"tEXt" and data.split(b"\0", 1)[0] == STAMP_KEY)]
    body = b"".join(_chunk(kind, data) for kind, data in kept if kind != b"IEND")
    return _SIGNATURE + body + _chunk(b"tEXt", STAMP_KEY + b"\0" + fingerprint.encode()) + _chunk(b"IEND", b"")


def stamp_of(png: bytes) -> str | None:
    """The page stamp of ``png`` (None: it has none)."""
    for kind, data in _chunks(png):
        key, _, value = data.partition(b"\0")
        if kind == b"tEXt" and key == STAMP_KEY:
            return value.decode("ascii", "replace")
    return None
