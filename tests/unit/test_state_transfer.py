"""The state transfer's description (elasticctl.train.state_transfer.transfer, in elasticctl.train.state_transfer.description's one
format): what a receiver reads from a peer and checks against its own state before anything is copied. The transfer itself runs between
processes: tests/process/test_hot.py."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from elasticctl.train.state_transfer import description, transfer
from elasticctl.train.state_transfer.description import Own, TensorSpec, check_description, rebuild
from elasticctl.train.sampler import ResumableSampler
from elasticctl.train.state import State, StateError
from elasticctl.train.state_transfer.transfer import describe, parse_description

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _state(seed: int = 0, width: int = 4, trained: bool = False) -> State:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = State(model, optimizer, sampler=ResumableSampler(list(range(20)), num_replicas=1, rank=0),
                  samples_seen=0, ema=torch.zeros(2))
    if trained:
        model(torch.randn(5, width)).sum().backward()
        state.samples_seen, state.ema = 12, torch.tensor([1.5, 2.5])
        state.commit(samples=3)
    return state


def _receive(receiver: State, blob: bytes, sent: list[torch.Tensor]) -> None:
    """What transfer_state does on a receiver, with the buckets' copy done directly."""
    skeleton, specs, _ = parse_description(blob)
    flag, tensors = transfer._take(receiver, skeleton, specs, torch.device("cpu"), sender=False)
    assert flag == transfer.RECEIVES
    for mine, theirs in zip(tensors, sent, strict=True):
        mine.copy_(theirs)
    receiver.load_state_dict(rebuild(skeleton, {s.path: t for s, t in zip(specs, tensors, strict=True)}))


def test_a_joiner_with_a_fresh_optimizer_ends_identical_to_the_sender():
    sender, receiver = _state(0, trained=True), _state(1)
    assert not receiver.optimizer.state
    blob, _, sent = describe(sender.state_dict())
    params_before = [p.data_ptr() for p in receiver.model.parameters()]
    _receive(receiver, blob, sent)
    assert [p.data_ptr() for p in receiver.model.parameters()] == params_before, "the model's own tensors are filled"
    assert receiver.step == 1 and receiver.samples_seen == 12 and receiver.live
    assert torch.equal(receiver.ema, sender.ema) and receiver.sampler.consumed == 3
    for a, b in zip(sender.model.state_dict().values(), receiver.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    theirs, mine = sender.optimizer.state_dict(), receiver.optimizer.state_dict()
    assert theirs["param_groups"] == mine["param_groups"]
    for index, per_param in theirs["state"].items():
        for key, value in per_param.items():
            assert torch.equal(value, mine["state"][index][key]) and value.dtype == mine["state"][index][key].dtype
    # and it trains on from there exactly as the sender does
    for state in (sender, receiver):
        torch.manual_seed(5)
        state.model(torch.randn(5, 4)).sum().backward()
        state.commit()
    for a, b in zip(sender.model.parameters(), receiver.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_flatten_and_rebuild_are_inverse_and_keep_module_metadata():
    tree = _state(trained=True).state_dict()
    skeleton, tensors = description.flatten(tree)
    again = rebuild(skeleton, dict(tensors))
    assert again["model"]._metadata == tree["model"]._metadata
    assert list(again["model"]) == list(tree["model"]) and again["sampler"] == tree["sampler"]


def _description(**changes) -> bytes:
    blob, specs, _ = describe(_state(trained=True).state_dict())
    description = torch.load(io.BytesIO(blob), weights_only=True)
    for key, value in changes.items():
        description[key] = value(description[key]) if callable(value) else value
    buffer = io.BytesIO()
    torch.save(description, buffer)
    return buffer.getvalue()


def _check(receiver: State, blob: bytes) -> None:
    skeleton, specs, _ = parse_description(blob)
    transfer._take(receiver, skeleton, specs, torch.device("cpu"), sender=False)


def _model(entries: list) -> list:
    """The description's entry for the model's first tensor ('0.weight')."""
    return next(entry for entry in entries if entry[0][0] == "model")


def _entries(edit):
    def change(entries):
        edit(entries)
        return entries
    return change


class _Code:
    def __reduce__(self):
        return (print, ("code from a peer ran",))


def _code_blob() -> bytes:
    buffer = io.BytesIO()
    torch.save({"format": 1, "state": {"step": 1, "model": _Code()}, "tensors": []}, buffer)
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("blob, error", [
    (b"", "cannot be read"),
    (b"not a description", "cannot be read"),
    (_code_blob(), "cannot be read"),
    (_description(format=2), "not one this worker reads"),
    (_description(state=lambda s: {**s, "step": "1"}), "holds no training state"),
    (_description(tensors="many"), "no valid list of tensors"),
    (_description(bucket_bytes=2**40), "bucket size out of bounds"),
    (_description(bucket_bytes="64"), "bucket size out of bounds"),
    (_description(tensors=_entries(lambda e: e.append(e[0]))), "twice"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(0, ["model", "nowhere"]))), "has no place for"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(0, []))), "no valid path"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(1, "Tensor"))), "unknown dtype"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(2, [-1, 4]))), "no valid shape"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(3, 1))), "where it lives"),
    # it reads, but does not fit this worker's state
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(2, [3, 5]))), r"'0.weight' received is float32 \[3, 5\]"),
    (_description(tensors=_entries(lambda e: _model(e).__setitem__(1, "float64"))), r"'0.weight' received is float64"),
    (_description(tensors=_entries(lambda e: e.remove(_model(e)))), "lacks the model's tensor '0.weight'"),
    (_description(state=lambda s: {k: v for k, v in s.items() if k != "sampler"}), "has no 'sampler'"),
    (_description(state=lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": []}}),
     "parameter groups of other sizes"),
    # an optimizer state far larger than the model: refused before anything is allocated
    (_description(tensors=_entries(lambda e: next(x for x in e if x[0][0] == "optimizer" and x[2])
                                   .__setitem__(2, [10**6, 10**6]))), "more than .* bytes of new tensors"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_description_that_does_not_fit_is_refused_with_one_sentence(blob, error):
    receiver = _state(1)
    before = [t.clone() for t in receiver.model.state_dict().values()]
    with pytest.raises(StateError, match=error):
        _check(receiver, blob)
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.model.state_dict().values(), strict=True))


def test_a_sender_whose_state_differs_from_the_lead_receives_instead():
    lead, other = _state(0, trained=True), _state(0)  # same shapes, no optimizer state yet
    skeleton, specs, _ = parse_description(describe(lead.state_dict())[0])
    flag, _ = transfer._take(other, skeleton, specs, torch.device("cpu"), sender=True)
    assert flag == transfer.RECEIVES
    flag, _ = transfer._take(_state(0, trained=True), skeleton, specs, torch.device("cpu"), sender=True)
    assert flag == transfer.SENDS


@pytest.mark.parametrize("bucket_bytes, error", [(255, "between 256"), (2**31, "between")])
def test_the_bucket_size_is_bounded(bucket_bytes, error):
    with pytest.raises(ValueError, match=error):
        transfer.check_bucket_bytes(bucket_bytes)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_only_ever_raise_state_error(blob):
    try:
        parse_description(blob)
    except StateError:
        pass


KEYS = st.one_of(st.text(max_size=6), st.integers(-3, 10), st.sampled_from(["model", "optimizer", "state", "0.weight"]))
ENTRY = st.tuples(
    st.one_of(st.lists(KEYS, max_size=4), st.none(), st.integers()),
    st.one_of(st.sampled_from(sorted(description.DTYPES)), st.text(max_size=8), st.none()),
    st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), st.text(max_size=3)),
    st.one_of(st.booleans(), st.integers(0, 1)),
).map(list)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 50), ENTRY), max_size=4), drop=st.lists(st.integers(0, 50), max_size=3),
       step=st.one_of(st.integers(), st.text(max_size=3), st.none()))
def test_mutated_descriptions_only_ever_raise_state_error_and_never_allocate_beyond_the_bound(edits, drop, step):
    def mutate(entries):
        for index in drop:
            if entries:
                entries.pop(index % len(entries))
        for index, entry in edits:
            if entries and index % 2:
                entries[index % len(entries)] = entry
            else:
                entries.append(entry)
        return entries
    blob = _description(tensors=mutate, state=lambda s: {**s, "step": step})
    receiver = _state(1)
    try:
        skeleton, specs, _ = parse_description(blob)
    except StateError:
        return
    _, found = description.flatten(receiver.state_dict())
    own = {path: Own(description.DTYPE_NAMES[t.dtype], tuple(t.shape)) for path, t in found}
    limit = description.allocation_limit(own)
    try:
        reuse = check_description(skeleton, specs, own, objects=receiver.objects().keys(),
                                  own_param_groups=[len(list(receiver.model.parameters()))],
                                  allocation_limit=limit, sender=False)
    except StateError:
        return
    assert sum(s.nbytes for s, in_place in zip(specs, reuse, strict=True) if not in_place) <= limit
    assert all(isinstance(s, TensorSpec) and s.path[0] != "model" or in_place for s, in_place in zip(specs, reuse))
    reached.add("accepted")


reached: set[str] = set()


def test_the_fuzzing_reaches_accepted_descriptions():
    """The property above is not vacuous: some mutated descriptions pass every check."""
    test_mutated_descriptions_only_ever_raise_state_error_and_never_allocate_beyond_the_bound()
    assert "accepted" in reached


@pytest.mark.parametrize("sections, error", [
    ({"bucket_bytes": None}, r"bucket size out of bounds \(None\)"),
    ({"tensors": _entries(lambda e: e.remove(_model(e))), "values": [[["model", "0.weight"], torch.zeros(3, 4), True]]},
     "sections a state transfer does not take"),
])
def test_the_transfer_takes_only_its_own_sections_of_the_one_format(sections, error):
    blob = _description(**{key: value for key, value in sections.items() if value is not None})
    if sections.get("bucket_bytes", 0) is None:
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        del loaded["bucket_bytes"]
        buffer = io.BytesIO()
        torch.save(loaded, buffer)
        blob = buffer.getvalue()
    with pytest.raises(StateError, match=error):
        parse_description(blob)


def test_one_format_carries_every_section_and_reads_back_what_was_written():
    state = _state(trained=True)
    skeleton, found = description.flatten(state.state_dict())
    specs = [TensorSpec(path, description.DTYPE_NAMES[t.dtype], tuple(t.shape), True) for path, t in found]
    blob = description.describe_state(skeleton, specs[:2], bucket_bytes=4096, sharded=[specs[2]],
                                      values=[(specs[3].path, found[3][1], True)])
    read = description.read_description(blob)
    assert read.state == skeleton and read.tensors == specs[:2] and read.bucket_bytes == 4096
    assert read.sharded == [specs[2]] and list(read.values) == [specs[3].path]
    assert torch.equal(read.values[specs[3].path][0], found[3][1])


@pytest.mark.parametrize("values, error", [
    ([[["model", "0.weight"], "not a tensor", True]], "Value 0 of .* is malformed"),
    ([[["model", "0.weight"], torch.zeros(2), 1]], "Value 0 of .* is malformed"),
    ([[[], torch.zeros(2), True]], "no valid path"),
    ([[["model", "nowhere"], torch.zeros(2), True]], "has no place for"),
    ([[["model", "0.weight"], torch.zeros(2), True], [["model", "0.weight"], torch.zeros(2), True]], "twice"),
    # a view of one element claiming 2**25 (stride 0): counted as what it would take once copied
    ([[["model", "0.weight"], torch.zeros(1).expand(2**25), True]], "more than .* bytes of tensors in itself"),
])
def test_values_carried_in_a_description_are_checked(values, error):
    skeleton, _ = description.flatten(_state().state_dict())
    with pytest.raises(StateError, match=error):
        description.read_description(description.describe_state(skeleton, values=[tuple(v) for v in values]))
