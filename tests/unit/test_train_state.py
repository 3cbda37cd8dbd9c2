"""The hot-recovery runtime's pure parts: its settings codec, the state a peer sends, the keys."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elasticctl.errors import ConfigError
from elasticctl.job.keys import JobKeys
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import HotSettings, WorkerSettings, parse_rdzv_options
from elasticctl.train.sampler import ResumableSampler
from elasticctl.train.state import State, StateError


def _state(seed: int = 0) -> State:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return State(model, optimizer, sampler=ResumableSampler(list(range(20)), num_replicas=1, rank=0),
                 samples_seen=0)


def test_the_state_a_peer_sends_makes_the_receiver_identical():
    sender, receiver = _state(0), _state(1)
    sender.model(torch.randn(3, 4)).sum().backward()
    sender.samples_seen = 12
    sender.commit(samples=3)  # momentum buffers exist now, the sampler moved, the step counted
    receiver.load_bytes(sender.to_bytes(), torch.device("cpu"))
    assert receiver.step == 1 and receiver.samples_seen == 12 and receiver.live
    assert receiver.sampler.consumed == sender.sampler.consumed == 3
    for a, b in zip(sender.model.parameters(), receiver.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert receiver.optimizer.state_dict()["state"].keys() == sender.optimizer.state_dict()["state"].keys()


def test_fields_are_attributes_and_unknown_ones_say_so():
    state = _state()
    state.samples_seen += 5
    assert state.samples_seen == 5 and state.fields == {"samples_seen": 5}
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = state.nope


class _Code:
    def __reduce__(self):
        return (print, ("code from a peer ran",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("blob", [
    b"", b"not a state", b"\x80\x04K\x01.",  # a pickle of 1: not a training state
])
def test_a_blob_that_is_no_state_is_refused(blob):
    with pytest.raises(StateError):
        _state().load_bytes(blob, torch.device("cpu"))


def test_a_blob_that_would_run_code_is_refused():
    buffer = io.BytesIO()
    torch.save({"step": 1, "model": _Code()}, buffer)
    with pytest.raises(StateError, match="cannot be read"):
        _state().load_bytes(buffer.getvalue(), torch.device("cpu"))


def test_a_state_of_another_model_is_refused():
    other = State(nn.Linear(3, 3))
    with pytest.raises(StateError, match="'model' state received does not fit"):
        _state().load_bytes(other.to_bytes(), torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_state_error(blob):
    try:
        _state().load_bytes(blob, torch.device("cpu"))
    except StateError:
        pass


@pytest.mark.parametrize(("hot", "error"), [
    ({"min_nodes": 2, "max_nodes": 3}, None),
    ({"min_nodes": 2, "max_nodes": 3, "node_ttl": 7, "last_call": 2.5, "reform_last_call": 0.25,
      "join_timeout": 60}, None),
    ({"min_nodes": 2}, "miss max_nodes"),
    ({"min_nodes": 3, "max_nodes": 2}, "node counts (3:2)"),
    ({"min_nodes": 0, "max_nodes": 2}, "node counts (0:2)"),
    ({"min_nodes": 1, "max_nodes": 2, "color": "red"}, "setting 'color'"),
    ({"min_nodes": "one", "max_nodes": 2}, "node counts ('one':2)"),
    ({"min_nodes": 1, "max_nodes": 2, "last_call": -1}, "last_call (-1) must be a positive"),
    ({"min_nodes": 1, "max_nodes": 2, "node_ttl": "nan"}, "node_ttl ('nan') must be a whole number"),
])
def test_hot_settings_codec(hot, error):
    # The hot section of the worker settings document: every field, each default filled in.
    fields = {**dataclasses.asdict(HotSettings(min_nodes=1, max_nodes=1)), **hot}
    for name in ("min_nodes", "max_nodes"):
        if name not in hot:
            del fields[name]
    text = json.dumps({"version": 3, "recovery": "hot", "stragglers": None, "hot": fields, "replicas": None,
                       "non_finite": None})
    if error is None:
        decoded = WorkerSettings.from_json(text)
        assert decoded.hot == HotSettings(**hot) and WorkerSettings.from_json(decoded.to_json()) == decoded
    else:
        with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
            WorkerSettings.from_json(text)


def test_recovery_is_a_rendezvous_option():
    assert parse_rdzv_options({"recovery": "HOT"}).recovery is RecoveryMode.HOT
    assert parse_rdzv_options({}).recovery is RecoveryMode.RESTART
    with pytest.raises(ConfigError, match="recovery \\('warm'\\) must be one of: restart, hot"):
        parse_rdzv_options({"recovery": "warm"})


def test_generations_use_the_rendezvous_layout_under_their_own_prefix():
    keys = JobKeys("job")
    generations = keys.generations()
    assert generations.rdzv_round == "/elasticctl/jobs/job/generations/ctl/round"
    assert generations.rdzv_node("a.0") == "/elasticctl/jobs/job/generations/nodes/a.0"
    assert keys.rdzv_round == "/elasticctl/jobs/job/rdzv/ctl/round"
    assert not generations.rdzv.startswith(keys.rdzv) and generations.progress == keys.progress
