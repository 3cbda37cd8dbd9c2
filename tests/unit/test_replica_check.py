"""The replica check (elasticctl.train.watches.replica_check, replica_watch): the rule that names a diverged
replica, the checksum it compares, its settings and what a worker does with a verdict.

Layer tests/unit: no etcd, no processes; the watch's all-gather is replaced by the reports a
test hands it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import MLP, up_dry_run_in_process
from torch import nn

from elasticctl.errors import ConfigError
from elasticctl.job.records import Event, EventKind
from elasticctl.job.settings import ReplicaCheckSettings, WorkerSettings, parse_rdzv_options
from elasticctl.train.watches import replica_watch
from elasticctl.train.groups.roster import encode_name
from elasticctl.train.watches.replica_check import (
    NO_REPLICA,
    Diverged,
    NoMajority,
    ReplicasDisagree,
    ReplicaVerdict,
    judge_replicas,
    parameters_digest,
    tensors_digest,
)
from elasticctl.train.watches.replica_watch import ReplicaWatch
from support.watches import collecting

A, B, C = 0xA, 0xB, 0xC  # checksums


# -- the rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("reports", "verdict"), [
    pytest.param([], ReplicaVerdict(), id="nobody"),
    pytest.param([(A, 0)], ReplicaVerdict(), id="one-worker"),
    pytest.param([(A, 0), (A, 0), (A, 0)], ReplicaVerdict(), id="ddp-all-agree"),
    pytest.param([(A, 0), (B, 0), (A, 0)], ReplicaVerdict(diverged=(Diverged(1, 0, 2, 3),)), id="ddp-one-flipped"),
    pytest.param([(B, 0), (A, 0), (A, 0), (A, 0)], ReplicaVerdict(diverged=(Diverged(0, 0, 3, 4),)),
                 id="rank-0-is-the-one-flipped"),
    pytest.param([(A, 0), (B, 0), (C, 0), (A, 0), (A, 0)],
                 ReplicaVerdict(diverged=(Diverged(1, 0, 3, 5), Diverged(2, 0, 3, 5))), id="two-flipped-of-five"),
    pytest.param([(A, 0), (B, 0)], ReplicaVerdict(no_majority=(NoMajority(0, (0, 1), 2),)),
                 id="two-replicas-differ-no-majority"),
    pytest.param([(A, 0), (A, 0), (B, 0), (B, 0)], ReplicaVerdict(no_majority=(NoMajority(0, (0, 1, 2, 3), 2),)),
                 id="a-2-2-split"),
    pytest.param([(A, 0), (B, 0), (C, 0)], ReplicaVerdict(no_majority=(NoMajority(0, (0, 1, 2), 3),)),
                 id="three-different"),
    # HSDP: ranks 0, 2, 4 hold shard 0 and ranks 1, 3, 5 shard 1; each set is judged on its own
    pytest.param([(A, 0), (C, 1), (A, 0), (C, 1), (A, 0), (C, 1)], ReplicaVerdict(), id="hsdp-shards-differ-replicas-agree"),
    pytest.param([(A, 0), (C, 1), (B, 0), (C, 1), (A, 0), (C, 1)], ReplicaVerdict(diverged=(Diverged(2, 0, 2, 3),)),
                 id="hsdp-one-replica-of-shard-0-flipped"),
    pytest.param([(A, 0), (C, 1), (A, 0), (B, 1)], ReplicaVerdict(no_majority=(NoMajority(1, (1, 3), 2),)),
                 id="hsdp-two-replicas-of-shard-1-differ"),
    pytest.param([(A, 0), (C, 1), (A, 0), (C, 1), (B, 0), (C, 1), (B, 0)],
                 ReplicaVerdict(no_majority=(NoMajority(0, (0, 2, 4, 6), 2),)), id="hsdp-split-in-one-set-only"),
    pytest.param([(A, 0), (B, 1), (A, 0), (C, 1), (0xD, 0), (C, 1), (C, 1)],
                 ReplicaVerdict(diverged=(Diverged(1, 1, 3, 4), Diverged(4, 0, 2, 3))), id="hsdp-one-per-set"),
    # FSDP without replicas: every rank alone, nothing compared
    pytest.param([(A, NO_REPLICA), (B, NO_REPLICA), (C, NO_REPLICA)], ReplicaVerdict(), id="fsdp-no-replica"),
    pytest.param([(A, 0), (B, 1), (C, 2)], ReplicaVerdict(), id="sets-of-one"),
    pytest.param([(A, 0), (B, -7), (A, 0)], ReplicaVerdict(), id="any-negative-key-is-no-replica"),
])
def test_judge_replicas(reports, verdict):
    assert judge_replicas(reports) == verdict
    assert judge_replicas(reports).agree is (verdict == ReplicaVerdict())


def test_a_verdict_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        judge_replicas([(A, 0)]).diverged = ()  # type: ignore[misc]


_SETS = st.lists(st.tuples(st.integers(0, 3), st.integers(-(2**63), 2**63 - 1)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.integers(-1, 3), max_size=12), checksum=st.integers(-(2**63), 2**63 - 1))
def test_replicas_that_all_agree_name_nobody(keys, checksum):
    assert judge_replicas([(checksum, key) for key in keys]) == ReplicaVerdict()


@settings(max_examples=300, deadline=None)
@given(members=st.integers(3, 9), others=_SETS, data=st.data())
def test_a_single_flipped_rank_in_a_set_of_three_or_more_is_the_one_named(members, others, data):
    checksum = data.draw(st.integers(0, 2**62))
    flipped_checksum = checksum ^ (1 << data.draw(st.integers(0, 62)))
    # The set under test is key 9, spread among the other sets' ranks, whose verdicts are their own.
    reports = [(digest, key) for key, digest in others]
    positions = sorted(data.draw(st.lists(st.integers(0, len(reports) + members), min_size=members,
                                          max_size=members)))
    for position in positions:
        reports.insert(min(position, len(reports)), (checksum, 9))
    ranks = [rank for rank, (_, key) in enumerate(reports) if key == 9]
    flipped = data.draw(st.sampled_from(ranks))
    reports[flipped] = (flipped_checksum, 9)
    verdict = judge_replicas(reports)
    assert [d.rank for d in verdict.diverged if d.replica_set == 9] == [flipped]
    assert all(split.replica_set != 9 for split in verdict.no_majority)


@settings(max_examples=300, deadline=None)
@given(reports=st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 2)), max_size=10))
def test_every_compared_rank_is_agreeing_diverged_or_in_a_set_without_majority(reports):
    verdict = judge_replicas(reports)
    named = [d.rank for d in verdict.diverged]
    split = [rank for s in verdict.no_majority for rank in s.ranks]
    assert len(named) == len(set(named)) and not set(named) & set(split)
    for d in verdict.diverged:  # a named rank is outvoted by a strict majority of its set
        members = [c for c, key in reports if key == d.replica_set]
        assert 2 * d.agreeing > d.members == len(members) and members.count(reports[d.rank][0]) < d.agreeing


# -- the checksum -----------------------------------------------------------------------------

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))


def test_the_same_parameters_give_the_same_checksum():
    a, b = _model(), _model()
    assert parameters_digest(a) == parameters_digest(b) == parameters_digest(a)
    assert 0 <= parameters_digest(a) < 2**63


@pytest.mark.parametrize("parameter", [0, 1, 2, 3])
@pytest.mark.parametrize("bit", [0, 7, 16, 31])
def test_one_flipped_bit_anywhere_changes_the_checksum(parameter, bit):
    model = _model()
    before = parameters_digest(model)
    tensor = list(model.parameters())[parameter]
    with torch.no_grad():
        words = tensor.view(torch.int32).view(-1)
        words[words.numel() // 2] ^= torch.tensor(1 << bit if bit < 31 else -(2**31), dtype=torch.int32)
    assert parameters_digest(model) != before


def test_every_single_bit_of_a_small_tensor_counts():
    tensor = torch.randn(3, 5)
    before = tensors_digest([tensor])
    raw = tensor.view(torch.uint8).view(-1)
    for byte in range(raw.numel()):
        for bit in range(8):
            raw[byte] ^= 1 << bit
            assert tensors_digest([tensor]) != before, (byte, bit)
            raw[byte] ^= 1 << bit
    assert tensors_digest([tensor]) == before


def test_the_checksum_depends_on_positions_and_order():
    x = torch.arange(12, dtype=torch.float32)
    swapped = x.clone()
    swapped[[2, 9]] = swapped[[9, 2]]
    assert tensors_digest([x]) != tensors_digest([swapped])
    a, b = torch.ones(4), torch.full((4,), 2.0)
    assert tensors_digest([a, b]) != tensors_digest([b, a])


def test_odd_sizes_and_views_are_read_as_bytes_without_error():
    half = torch.randn(7, dtype=torch.float16)
    assert tensors_digest([half]) == tensors_digest([half.clone()])
    base = torch.randn(4, 6)
    assert tensors_digest([base.t()]) == tensors_digest([base.t().contiguous()])  # the values, as laid out
    assert tensors_digest([base[:, 1:]]) == tensors_digest([base[:, 1:].contiguous()])
    assert tensors_digest([torch.tensor(3.0), torch.empty(0)]) == tensors_digest([torch.tensor(3.0)])
    assert tensors_digest([]) == 0


def test_a_chunked_parameter_weighs_the_same_as_one_chunk(monkeypatch):
    from elasticctl.train.watches import replica_check

    tensor = torch.randn(5 * replica_check._WIDTH + 7)  # six rows, the last one padded
    whole = tensors_digest([tensor])
    monkeypatch.setattr(replica_check, "_CHUNK_ROWS", 2)  # three chunks
    assert tensors_digest([tensor]) == whole


# -- the settings ---------------------------------------------------------------------------

def test_the_defaults_check_every_100_steps_and_evict_nobody():
    assert ReplicaCheckSettings.of(parse_rdzv_options({}), min_nodes=2) == ReplicaCheckSettings(100, 0, 2)
    settings_ = WorkerSettings.of(parse_rdzv_options({"replica_check": "0", "evict_diverged": "1"}), 2, 3)
    assert settings_.replicas == ReplicaCheckSettings(interval=0, evict=1, min_nodes=2)
    assert WorkerSettings.from_json(settings_.to_json()) == settings_


@pytest.mark.parametrize(("conf", "message"), [
    ({"replica_check": "-1"}, "The rendezvous option replica_check (--replica-check) ('-1') must be a whole number "
                              "of steps from 0 to 1000000."),
    ({"evict_diverged": "yes"}, "The rendezvous option evict_diverged (--evict-diverged) ('yes') must be a whole "
                                "number from 0 to 1."),
    ({"evict_diverged": "2"}, "must be a whole number from 0 to 1."),
])
def test_a_bad_setting_is_one_sentence_naming_it(conf, message):
    with pytest.raises(ConfigError) as caught:
        parse_rdzv_options(conf)
    assert message in str(caught.value) and "\n" not in str(caught.value)


_up = up_dry_run_in_process


def test_up_hands_the_replica_flags_to_the_rendezvous_options():
    code, stdout, stderr = _up("--replica-check", "5", "--evict-diverged", "1")
    assert code == 0, stderr
    conf = dict(item.split("=", 1) for item in stdout.split("--rdzv-conf=")[1].split()[0].split(","))
    assert conf["replica_check"] == "5" and conf["evict_diverged"] == "1"


def test_a_bad_replica_flag_is_a_one_line_error():
    code, _, stderr = _up("--replica-check", "x")
    assert code != 0 and stderr.count("\n") == 1 and stderr.startswith("elasticctl: error: "), stderr
    assert "replica_check (--replica-check) ('x') must be a whole number of steps from 0 to 1000000." in stderr


def test_a_replica_event_round_trips():
    event = Event(time=100.0, kind=EventKind.REPLICA_DIVERGED, node="c", step=25, world_size=3,
                  reason="rank 1's parameters differ")
    assert Event.from_json(event.to_json().encode()) == event


# -- the watch: what a worker does with a verdict ---------------------------------------------

@dataclasses.dataclass
class _Group:
    rank: int
    world_size: int
    number: int = 1


class _Exchange:
    """Stands in for dist.all_gather: the node names, then the (checksum, key) reports."""

    def __init__(self, nodes: list[str], reports: list[tuple[int, int]]) -> None:
        self.nodes, self.reports, self.sent = nodes, reports, []

    def __call__(self, out, tensor, group=None) -> None:
        self.sent.append(tensor.clone())
        if tensor.dtype == torch.uint8:
            for slot, node in zip(out, self.nodes):
                slot.copy_(torch.tensor(encode_name(node), dtype=torch.uint8))
        else:
            for slot, report in zip(out, self.reports):
                slot.copy_(torch.tensor(report, dtype=torch.int64))


def _watch(monkeypatch, reports, *, nodes=("a", "b", "c"), evict=0, interval=5, min_nodes=1, key=0,
           sharded=False):
    exchange = _Exchange(list(nodes), reports)
    monkeypatch.setattr(replica_watch.dist, "all_gather", exchange)
    events, leaves = [], []
    watch = collecting(ReplicaWatch(ReplicaCheckSettings(interval=interval, evict=evict, min_nodes=min_nodes), "a.0",
                                    "a", control_group=lambda: None, replica_set=lambda: key, sharded=sharded),
                       events, leaves)
    watch.new_generation()
    return watch, exchange, events, leaves


def test_rank_0_names_the_diverged_node_once_per_generation(monkeypatch):
    watch, exchange, events, leaves = _watch(monkeypatch, [(A, 0), (B, 0), (A, 0)])
    model = _model()
    watch.at_boundary(_Group(0, 3), 24, model)  # not a check's step: nothing exchanged
    assert exchange.sent == [] and events == []
    watch.at_boundary(_Group(0, 3), 25, model)
    assert exchange.sent[1].tolist() == [parameters_digest(model), 0]  # this worker's own report, on the CPU
    assert [(kind, fields["node"], fields["step"]) for kind, fields in events] == [
        (EventKind.REPLICA_DIVERGED, "b", 25)]
    assert "rank 1's parameters differ from those of 2 of its 3 replicas" in events[0][1]["reason"]
    watch.at_boundary(_Group(0, 3), 30, model)
    assert len(events) == 1 and leaves == []  # still diverged: named once per generation
    watch.new_generation()
    watch.at_boundary(_Group(0, 3), 35, model)
    assert len(events) == 2


def test_only_rank_0_records_and_evicts(monkeypatch):
    watch, _, events, leaves = _watch(monkeypatch, [(A, 0), (B, 0), (A, 0)], evict=1)
    watch.at_boundary(_Group(2, 3), 25, _model())
    assert events == [] and leaves == []


def test_eviction_asks_the_diverged_node_to_leave_once_per_run(monkeypatch):
    watch, _, events, leaves = _watch(monkeypatch, [(A, 0), (B, 0), (A, 0)], evict=1)
    for step in (25, 30):
        watch.at_boundary(_Group(0, 3), step, _model())
    watch.new_generation()
    watch.at_boundary(_Group(0, 3), 35, _model())
    assert leaves == ["b"]
    assert any("evicted" in fields["reason"] for _, fields in events)


def test_no_eviction_below_the_minimum_nodes(monkeypatch):
    watch, _, events, leaves = _watch(monkeypatch, [(A, 0), (B, 0), (A, 0)], evict=1, min_nodes=3)
    watch.at_boundary(_Group(0, 3), 25, _model())
    assert leaves == [] and [fields["node"] for _, fields in events] == ["b"]


@pytest.mark.parametrize("rank", [0, 1])
def test_no_majority_stops_every_rank_with_one_sentence(monkeypatch, rank):
    watch, exchange, events, _ = _watch(monkeypatch, [(A, 0), (A, 0)], nodes=("a", "b"))
    watch.at_boundary(_Group(rank, 2), 20, _model())
    assert watch.agreed_at == 20  # the last step every replica agreed at
    exchange.reports = [(A, 0), (B, 0)]
    with pytest.raises(ReplicasDisagree) as caught:
        watch.at_boundary(_Group(rank, 2), 25, _model())
    assert str(caught.value) == (
        "The replicas (ranks 0, 1) hold 2 different parameter checksums at step 25 and none is held by a majority, "
        "so the job stops; the replicas last agreed at step 20: resume from a checkpoint of that step or older.")
    assert [(fields["node"], fields["step"]) for _, fields in events] == ([("", 25)] if rank == 0 else [])
    assert watch.agreed_at == 20


def test_a_sharded_model_without_replicas_exchanges_nothing(monkeypatch):
    watch, exchange, events, _ = _watch(monkeypatch, [(A, 0), (B, 0)], key=None, sharded=True)
    watch.at_boundary(_Group(0, 2), 25, _model())
    assert exchange.sent == [] and events == []


def test_hsdp_names_the_shard(monkeypatch):
    watch, _, events, _ = _watch(monkeypatch, [(A, 0), (C, 1), (B, 0), (C, 1), (A, 0), (C, 1)],
                                 nodes=("a", "a", "b", "b", "c", "c"), key=0, sharded=True)
    watch.at_boundary(_Group(0, 6), 25, _model())
    assert [fields["node"] for _, fields in events] == ["b"] and "of shard 0" in events[0][1]["reason"]


@pytest.mark.parametrize("settings_", [None, ReplicaCheckSettings(interval=0)])
def test_off_or_alone_nothing_is_exchanged(monkeypatch, settings_):
    exchange = _Exchange(["a"], [])
    monkeypatch.setattr(replica_watch.dist, "all_gather", exchange)
    watch = ReplicaWatch(settings_, "a.0", "a", control_group=lambda: None, replica_set=lambda: 0,
                         sharded=False)
    watch.at_boundary(_Group(0, 3), 100, _model())
    ReplicaWatch(ReplicaCheckSettings(interval=5), "a.0", "a", control_group=lambda: None, replica_set=lambda: 0,
                 sharded=False).at_boundary(_Group(0, 1), 100, _model())
    assert exchange.sent == []


def test_a_peer_that_sends_a_bad_node_id_is_compared_but_not_named(monkeypatch):
    watch, _, events, leaves = _watch(monkeypatch, [(A, 0), (B, 0), (A, 0)], nodes=("a", "../x", "c"), evict=1)
    watch.at_boundary(_Group(0, 3), 25, _model())
    assert events == [] and leaves == []


# -- the trainer's knob: --flip-bit STEP:RANK --------------------------------------------------

def _mlp_trainer(monkeypatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("mlp_trainer_under_test", MLP)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_flip_bit_knob_is_parsed_and_flips_one_bit_the_check_sees(monkeypatch, capsys):
    mlp = _mlp_trainer(monkeypatch)
    assert mlp.parse_args(["--flip-bit", "20:1"]).flip_bit == (20, 1)
    assert mlp.parse_args([]).flip_bit is None
    for bad in ("20", "x:1", "20:-1", "20:1:2"):
        with pytest.raises(SystemExit):
            mlp.parse_args(["--flip-bit", bad])
        assert "--flip-bit" in capsys.readouterr().err
    model, replica = _model(), _model()
    mlp.flip_one_bit(model)
    first, copy = next(model.parameters()), next(replica.parameters())
    differs = (first.view(torch.int32) ^ copy.view(torch.int32)).view(-1)
    assert differs.count_nonzero() == 1 and differs[0] == 1 << mlp.FLIPPED_BIT
    assert parameters_digest(model) != parameters_digest(replica)
