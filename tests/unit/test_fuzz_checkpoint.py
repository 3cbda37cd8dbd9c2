"""Property tests of everything checkpoint.py and checkpoints/sharded.py decode from disk: digest
files, payloads, sharded manifests, DCP metadata. Whatever the bytes, the answer is a checkpoint,
a CheckpointError or a checkpoint skipped in favour of an older one; never another exception, never
code running."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import itertools
import json
import os
import pathlib
import pickle
import pickletools
import shutil
import struct
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from support.checkpoints import CreatesAFile, make_state, sharded_state, write_manifest
from torch import nn

from elasticctl.train import checkpoint
from elasticctl.train.checkpoints import sharded as sharded_checkpoint
from elasticctl.train.checkpoint import Checkpointer, CheckpointError, ShardedCheckpointer

FUZZ = settings(max_examples=50, deadline=None)
# torch.load notes every pickle of a protocol it does not write; planted ones are the point here.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
STEP1, STEP2 = "step-00000001.pt", "step-00000002.pt"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Runs:
    """Pickles to a call of ``function(*args)``: what a planted file would have unpickled."""

    def __init__(self, function, *args) -> None:
        self.call = (function, args)

    def __reduce__(self):
        return self.call


def code_that_creates(marker: Path) -> st.SearchStrategy:
    """Pickled calls that each create ``marker`` if anything unpickles them unrestricted."""
    return st.sampled_from([
        Runs(open, str(marker), "w"),
        Runs(os.system, f"touch '{marker}'"),
        Runs(eval, f"open({str(marker)!r}, 'w')"),
        Runs(exec, f"open({str(marker)!r}, 'w')"),
        Runs(subprocess.call, ["touch", str(marker)]),
        Runs(pathlib.Path.touch, marker),
        CreatesAFile(marker),
    ])


def nested(value) -> st.SearchStrategy:
    """``value`` somewhere inside lists, tuples and dicts."""
    return st.recursive(st.just(value), lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=2), st.tuples(inner, st.integers()),
        st.dictionaries(st.text(max_size=3), inner, min_size=1, max_size=2)), max_leaves=4)


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    buffer = bytearray(data)
    for at, byte in edits:
        buffer[at % len(buffer)] = byte
    return bytes(buffer[:cut] if cut is not None else buffer)


def operands(data: bytes, start: int = 0) -> list[int]:
    """Offsets of the operand bytes in the pickle at ``data[start:]`` (numbers, lengths, strings):
    changed there, the pickle mostly still parses, so the values reach the code that uses them."""
    ops = [pos for _, _, pos in pickletools.genops(data[start:])]
    return [start + at for pos, end in itertools.pairwise(ops) for at in range(pos + 1, end)]


def edits_in(length: int, hot: list[int] | None = None) -> st.SearchStrategy:
    """A few byte replacements, mostly at ``hot`` offsets if given."""
    at = st.integers(0, length - 1)
    if hot:
        at = st.one_of(st.sampled_from(hot), st.sampled_from(hot), at)
    return st.lists(st.tuples(at, st.integers(0, 255)), min_size=1, max_size=4)


def paths(value, path: tuple = ()):
    """Every place in a structure of containers and dataclasses, the whole included."""
    yield path
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, (list, tuple)):
        children = enumerate(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    else:
        return
    for key, child in children:
        yield from paths(child, (*path, key))


def replaced(value, path: tuple, new):
    """A copy of ``value`` with ``new`` at ``path`` (containers rebuilt, torch.Size included)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: replaced(v, rest, new) if k == key else v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)([replaced(v, rest, new) if i == key else v for i, v in enumerate(value)])
    clone = copy.copy(value)
    object.__setattr__(clone, key, replaced(getattr(value, key), rest, new))  # frozen ones too
    return clone


def structural_edit(data, value: object, leaves: st.SearchStrategy):
    """``value`` with one place replaced by a drawn leaf: wrong types, sizes, names, offsets."""
    path = data.draw(st.sampled_from(list(paths(value))))
    try:
        return replaced(value, path, data.draw(leaves))
    except (TypeError, ValueError, RuntimeError):  # e.g. a string inside a torch.Size
        assume(False)


plain_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=False),
    st.text(max_size=6), st.lists(st.integers(-1, 20), max_size=3),
    st.lists(st.integers(0, 20), max_size=3).map(torch.Size),
    st.sampled_from([torch.float16, torch.int64, torch.bool]))
tensor_leaves = st.lists(st.integers(0, 4), max_size=3).map(torch.zeros)


class Saved(dict):
    """The bytes of real checkpoints, kept out of hypothesis's failure reports."""

    def __repr__(self) -> str:
        return "<saved checkpoints>"


# -- single-file checkpoints ----------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of a real checkpoint, as bytes, and the operands of step 2's pickle."""
    directory = tmp_path_factory.mktemp("saved")
    ckpt = Checkpointer(directory, keep=2)
    state = make_state()
    ckpt.save(1, **state)
    ckpt.save(2, **state)
    step2 = (directory / STEP2).read_bytes()
    payload = torch.load(directory / STEP2, weights_only=True)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(step2)).infolist()
                if i.filename.endswith("data.pkl"))
    header = info.header_offset  # a zip local header: 30 bytes, then the name and an extra field
    name_length, extra_length = struct.unpack("<HH", step2[header + 26:header + 30])
    start = header + 30 + name_length + extra_length
    return Saved(step1=(directory / STEP1).read_bytes(), step2=step2, payload=payload,
                 operands=operands(step2[:start + info.compress_size], start))


@contextlib.contextmanager
def checkpoint_dir(saved, step2: bytes, digest2: bytes | None = None):
    """A directory with the real step 1 and ``step2`` (digest: of those bytes unless given)."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        (directory / STEP1).write_bytes(saved["step1"])
        (directory / f"{STEP1}.sha256").write_text(sha256(saved["step1"]))
        (directory / STEP2).write_bytes(step2)
        digest2 = digest2 if digest2 is not None else sha256(step2).encode()
        (directory / f"{STEP2}.sha256").write_bytes(digest2)
        yield directory


def readable(ckpt: Checkpointer, path: Path) -> bool:
    try:
        ckpt.read(path)
    except CheckpointError:
        return False
    return True


@FUZZ
@given(data=st.data())
def test_any_digest_file_verifies_the_checkpoint_or_skips_it(saved, data):
    right = sha256(saved["step2"])
    digest = data.draw(st.one_of(
        st.binary(max_size=300),
        st.text(max_size=80).map(str.encode),
        st.tuples(st.sampled_from([b"", b" ", b"\n", b"\t\r\n"]), st.just(right.encode()),
                  st.sampled_from([b"", b"\n", b"  \n"])).map(b"".join),
        st.just(right.upper().encode()), st.just(right[:-1].encode())))
    with checkpoint_dir(saved, saved["step2"], digest) as directory:
        payload = Checkpointer(directory).load_latest()
    assert payload["step"] == (2 if digest.strip() == right.encode() else 1)


@FUZZ
@given(data=st.data(), how=st.sampled_from(["bytes", "bytes, digest recomputed", "structure"]))
def test_mutated_payloads_load_or_are_skipped_and_never_evict_a_real_checkpoint(saved, data, how):
    original, digest = saved["step2"], None
    if how == "structure":  # still a valid torch.save, with one value of the wrong kind
        buffer = io.BytesIO()
        torch.save(structural_edit(data, saved["payload"], plain_leaves | tensor_leaves), buffer)
        mutated = buffer.getvalue()
    else:
        cut = data.draw(st.none() | st.integers(0, len(original)))
        mutated = mutate(original, data.draw(edits_in(len(original), saved["operands"])), cut)
        if how == "bytes":
            digest = sha256(original).encode()
    with checkpoint_dir(saved, mutated, digest) as directory:
        loads = readable(Checkpointer(directory), directory / STEP2)
        event(f"mutated step 2 {'loads' if loads else 'is skipped'}")
        payload = Checkpointer(directory).load_latest()
        assert payload["path"].endswith(STEP2 if loads else STEP1)
        if loads:
            with contextlib.suppress(CheckpointError):  # a state that does not fit is one sentence
                Checkpointer(directory).restore(**make_state(seed=1))
        Checkpointer(directory, keep=2).save(3, model=nn.Linear(2, 2))
        # Kept: step 3 and the newest checkpoint that loads; a file that does not is left alone.
        assert (directory / "step-00000003.pt").exists() and (directory / STEP2).exists()
        assert (directory / STEP1).exists() == (not loads)


@FUZZ
@given(data=st.data(), zipped=st.booleans())
def test_a_payload_that_would_run_code_is_skipped_and_never_runs(
        saved, data, zipped, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "code-ran"
    evil = data.draw(nested(data.draw(code_that_creates(marker))))
    payload = {"format": checkpoint.FORMAT, "step": 2, "epoch": 0, "world_size": 1, "state": {},
               "rng": {}, "extra": {"x": evil}}
    buffer = io.BytesIO()
    if zipped:
        torch.save(payload, buffer)
    else:
        pickle.dump(payload, buffer)
    with checkpoint_dir(saved, buffer.getvalue()) as directory:
        assert Checkpointer(directory).load_latest()["step"] == 1
        Checkpointer(directory, keep=1).save(3, model=nn.Linear(2, 2))
        assert (directory / STEP2).exists()  # left in place, not counted
    assert not marker.exists()


# -- sharded checkpoints --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory, process_group):
    """A real sharded checkpoint at step 1 (model and Adam state)."""
    directory = tmp_path_factory.mktemp("sharded")
    model, optimizer = sharded_state(0)
    ShardedCheckpointer(directory).save(1, model, optimizer, extra={"epoch": 1})
    return directory / "step-00000001"


@contextlib.contextmanager
def sharded_copy(sharded):
    with tempfile.TemporaryDirectory() as name:
        copy = Path(name) / sharded.name
        shutil.copytree(sharded, copy)
        yield copy


def restores_or_refuses(directory: Path):
    """What restore answers: extras, None, or a CheckpointError (anything else fails the test)."""
    try:
        return ShardedCheckpointer(directory.parent).restore(*sharded_state(1))
    except CheckpointError as exc:
        return exc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)


@FUZZ
@given(data=st.data())
def test_any_manifest_verifies_or_the_checkpoint_is_skipped(sharded, data):
    manifest = json.loads((sharded / sharded_checkpoint.MANIFEST).read_text())
    names = [*manifest["files"], "", ".", "..", "../x", "/etc/passwd", "a/b",
             sharded_checkpoint.MANIFEST]
    files = st.dictionaries(st.sampled_from(names) | st.text(max_size=8),
                            st.text(max_size=70) | json_values, max_size=5)
    changed = {**manifest, "files": data.draw(files | st.just(dict(manifest["files"])))}
    text = data.draw(st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.just(json.dumps(changed).encode()),
        st.just(json.dumps({**manifest, "format": data.draw(json_values)}).encode()),
        st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth)))
    with sharded_copy(sharded) as directory:
        (directory / sharded_checkpoint.MANIFEST).write_bytes(text)
        intact = text == json.dumps(manifest).encode() or (
            text == json.dumps(changed).encode() and changed == manifest)
        listed = ShardedCheckpointer(directory.parent).checkpoints()
        assert listed == ([(1, directory)] if intact else [])
        restored = restores_or_refuses(directory)
        assert restored == ({"step": 1, "epoch": 1} if intact else None)


@FUZZ
@given(data=st.data(), how=st.sampled_from(["bytes", "bytes, manifest recomputed", "structure"]))
def test_mutated_dcp_metadata_is_refused_or_restores(sharded, data, how):
    original = (sharded / ".metadata").read_bytes()
    recompute_manifest = how != "bytes"
    if how == "structure":  # allowed classes only, with one value of the wrong kind
        metadata = structural_edit(data,
                                   sharded_checkpoint._load_dcp_metadata(sharded / ".metadata"),
                                   plain_leaves)
        try:
            mutated = pickle.dumps(metadata)
        except (RuntimeError, TypeError, ValueError):  # e.g. TensorProperties refuses to pickle
            assume(False)
    else:
        cut = data.draw(st.none() | st.integers(0, len(original)))
        mutated = mutate(original, data.draw(edits_in(len(original), operands(original))), cut)
    with sharded_copy(sharded) as directory:
        (directory / ".metadata").write_bytes(mutated)
        try:
            metadata = sharded_checkpoint._load_dcp_metadata(directory / ".metadata")
            assert type(metadata).__name__ == "Metadata"
            event("mutated metadata unpickles")
        except CheckpointError:
            event("mutated metadata is refused")
        if recompute_manifest:
            write_manifest(directory)
        restored = restores_or_refuses(directory)
        event(f"restore answers {type(restored).__name__}")
        if not recompute_manifest and mutated != original:
            assert restored is None
        assert restored is None or isinstance(restored, CheckpointError) or restored["step"] == 1


@FUZZ
@given(data=st.data(), in_metadata=st.booleans())
def test_dcp_metadata_that_would_run_code_is_refused_and_never_runs(
        sharded, data, in_metadata, tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "code-ran"
    evil = data.draw(nested(data.draw(code_that_creates(marker))))
    with sharded_copy(sharded) as directory:
        if in_metadata:  # inside real metadata, where DCP keeps free-form data
            metadata = pickle.loads((sharded / ".metadata").read_bytes())
            metadata.planner_data = evil
            blob = pickle.dumps(metadata, protocol=data.draw(st.integers(2, 5)))
        else:
            blob = pickle.dumps(evil, protocol=data.draw(st.integers(0, 5)))
        (directory / ".metadata").write_bytes(blob)
        write_manifest(directory)
        with pytest.raises(CheckpointError, match="not one of the torch checkpoint metadata"):
            sharded_checkpoint._load_dcp_metadata(directory / ".metadata")
        assert restores_or_refuses(directory) is None
    assert not marker.exists()


@FUZZ
@given(blob=st.binary(max_size=400))
def test_random_bytes_as_dcp_metadata_are_refused(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("metadata") / ".metadata"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError):
        sharded_checkpoint._load_dcp_metadata(path)
