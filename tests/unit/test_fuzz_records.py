"""Random and mutated bytes into everything that decodes data another process wrote to etcd.

Property: only the project's documented errors come out (RendezvousStateError for the
rendezvous state, ConfigError for specs and options), never another exception, and
nothing planted ever runs.
"""

from __future__ import annotations

import json
import pickle
from datetime import datetime, timezone

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousStateError, dynamic_rendezvous

from elasticctl.errors import ConfigError
from elasticctl.job.records import (
    MEMBER_FIELDS,
    NODE_FIELDS,
    PROGRESS_FIELDS,
    Claim,
    Declaration,
    Event,
    EventKind,
    Reform,
    Round,
    json_object,
    typed_record,
)
from elasticctl.job.settings import KNOWN_OPTIONS, parse_rdzv_options
from elasticctl.rendezvous.state import open_state, seal_state
from elasticctl.job.registry import JobView
from elasticctl.job.spec import JobSpec
from elasticctl.status import render

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECRETS = st.sampled_from([None, b"s3cret"])


def _real_state() -> bytes:
    node_class = getattr(dynamic_rendezvous, "_NodeDesc")  # noqa: B009 - torch's private node class
    state = getattr(dynamic_rendezvous, "_RendezvousState")()  # noqa: B009
    node = node_class("10.0.0.1", 1234, 0)
    now = datetime.now(timezone.utc)
    state.round, state.complete, state.deadline = 3, True, now
    state.participants = {node: 0}
    state.wait_list, state.redundancy_list = {node}, set()
    state.last_heartbeats = {node: now}
    return pickle.dumps(state)


REAL_STATE = _real_state()


def _mutate(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in edits:
        if out:
            out[position % len(out)] = value
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8)


@FUZZ
@given(data=st.binary(max_size=4096), secret=SECRETS)
def test_random_bytes_as_a_sealed_state(data, secret):
    try:
        open_state(data, secret, "/fuzz/rdzv")
    except RendezvousStateError:
        pass


@FUZZ
@given(edits=EDITS, secret=SECRETS, seq=st.integers(0, 2**40))
def test_mutated_sealed_states(edits, secret, seq):
    sealed = seal_state(REAL_STATE, seq, secret)
    try:
        opened = open_state(_mutate(sealed, edits), secret, "/fuzz/rdzv")
    except RendezvousStateError:
        return
    assert opened.state == REAL_STATE  # a mutation that survives the seal changed nothing


@FUZZ
@given(edits=EDITS, seq=st.integers(0, 100))
def test_mutated_pickles_with_a_valid_checksum(edits, seq):
    # No secret: the attacker can compute the checksum, so the unpickler alone must hold.
    try:
        open_state(seal_state(_mutate(REAL_STATE, edits), seq, None), None, "/fuzz/rdzv")
    except RendezvousStateError:
        pass


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_pickles_with_a_valid_checksum(data):
    try:
        open_state(seal_state(b"\x80\x04" + data, 1, None), None, "/fuzz/rdzv")
    except RendezvousStateError:
        pass


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
SPEC_KEYS = st.sampled_from([
    "name", "script", "script_args", "min_nodes", "max_nodes", "nproc_per_node", "max_restarts",
    "rdzv_conf", "checkpoint_dir", "module", "env", "legacy_local_rank", "node_ttl", "other",
])


@FUZZ
@given(raw=st.binary(max_size=512))
def test_random_bytes_as_records(raw):
    record = json_object(raw)
    assert isinstance(record, dict)


@FUZZ
@given(fields=st.dictionaries(SPEC_KEYS, JSON, max_size=14))
def test_random_job_specs_from_etcd(fields):
    base = {"name": "job", "script": "train.py"}
    try:
        spec = JobSpec.from_dict({**base, **fields})
    except ConfigError:
        return
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


RECORD_KEYS = st.sampled_from(sorted({*NODE_FIELDS, *MEMBER_FIELDS, *PROGRESS_FIELDS, "x"}))
RECORDS = st.dictionaries(RECORD_KEYS, JSON, max_size=8).map(json.dumps).map(str.encode) | st.binary(max_size=64)


@settings(max_examples=100, deadline=None)
@given(nodes=st.lists(RECORDS, max_size=3), members=st.lists(RECORDS, max_size=3), progress=st.none() | RECORDS)
def test_status_of_random_records(nodes, members, progress):
    view = JobView(
        name="job", spec=None,
        nodes={f"n{i}": typed_record(raw, NODE_FIELDS) for i, raw in enumerate(nodes)},
        members={f"n{i}": typed_record(raw, MEMBER_FIELDS) for i, raw in enumerate(members)},
        progress=None if progress is None else typed_record(progress, PROGRESS_FIELDS),
        down_requested=False,
    )
    json.dumps(view.to_dict())
    render(view)


@FUZZ
@given(conf=st.dictionaries(st.sampled_from(sorted(KNOWN_OPTIONS)) | st.text(max_size=10),
                            st.text(max_size=30) | st.integers() | st.floats(), max_size=6))
def test_random_rendezvous_options(conf):
    try:
        parse_rdzv_options(conf)
    except ConfigError:
        pass


PROTOCOL_KEYS = st.sampled_from(["node", "addr", "wants", "pid", "port", "round", "members", "addrs",
                                 "master_port", "sig", "lost", "moved_on", "waiting", "seen_by"]) | st.text(max_size=8)


@FUZZ
@given(raw=st.binary(max_size=512) | st.dictionaries(PROTOCOL_KEYS, JSON, max_size=9).map(
    lambda d: json.dumps(d).encode()), secret=SECRETS, revision=st.integers(0, 2**40))
def test_random_rendezvous_records(raw, secret, revision):
    """Declarations, rounds and sealing claims from etcd: a record or None, never a crash; with a
    secret, nothing unsigned gets through."""
    for kind in (Declaration, Round, Claim, Reform):
        record = (kind.from_json(raw, "k", secret) if kind is Claim
                  else kind.from_json(raw, revision, "k", secret))
        assert record is None or isinstance(record, kind)
        if secret and record is not None:
            assert b'"sig"' in raw
        if isinstance(record, Round):
            assert len(set(record.members)) == len(record.members) and 0 <= record.master_port <= 65535
        if isinstance(record, Declaration):
            assert 0 <= record.port <= 65535 and record.wants >= 0
        if isinstance(record, Reform):
            assert all(isinstance(m, str) and "/" not in m for m in (*record.lost, *record.moved_on, *record.waiting))


@FUZZ
@given(node=st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True), wants=st.integers(0, 2**40),
       port=st.integers(0, 65535), secret=SECRETS)
def test_rendezvous_records_round_trip_and_are_bound_to_their_key(node, wants, port, secret):
    declaration = Declaration(node, "10.0.0.1", wants, port=port)
    raw = declaration.to_json("nodes/" + node, secret).encode()
    assert Declaration.from_json(raw, 0, "nodes/" + node, secret) == declaration
    if secret:  # a signed record moved to another key is not that key's record
        assert Declaration.from_json(raw, 0, "nodes/other", secret) is None


EVENT_KEYS = st.sampled_from(["time", "kind", "node", "round", "members", "world_size", "reason", "charged",
                              "duration"]) | st.text(max_size=8)
EVENT_VALUES = JSON | st.sampled_from([k.value for k in EventKind]) | st.lists(st.sampled_from(["a", "b", "a/b"]))


@FUZZ
@given(raw=st.binary(max_size=512) | st.dictionaries(EVENT_KEYS, EVENT_VALUES, max_size=9).map(
    lambda d: json.dumps(d).encode()))
def test_random_events(raw):
    """An event from etcd: a valid Event or None, never a crash; what it reads it writes back the same."""
    from elasticctl.job.events import render_line

    event = Event.from_json(raw)
    assert event is None or isinstance(event, Event)
    if event is not None:
        assert isinstance(event.kind, EventKind) and event.time >= 0
        assert Event.from_json(event.to_json().encode()) == event
        assert "\n" not in render_line(event)
