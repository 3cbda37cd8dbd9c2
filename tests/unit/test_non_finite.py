"""Non-finite values, attributed (elasticctl.train.watches.non_finite, non_finite_watch, ddp_hooks): the rule
that names the ranks, the decoding of a peer's report, the device checks, the settings, the one DDP
hook both watches look through, and what a worker in a world of one does with a NaN.

Layer tests/unit: no etcd, no processes (a world of one on an in-process store for DDP)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.helpers import up_dry_run_in_process
from torch import nn

from elasticctl.errors import ConfigError
from elasticctl.job.records import Event, EventKind
from elasticctl.job.settings import NonFiniteSettings, WorkerSettings, parse_rdzv_options
from elasticctl.train.watches.ddp_hooks import observe_buckets
from support.watches import collecting
from elasticctl.train.group import Group
from elasticctl.train.watches.non_finite import (
    NonFinite,
    RankFindings,
    finite_flag,
    gradients_finite,
    gradients_norm,
    judge_non_finite,
    read_flags,
    starts_a_run,
)
from elasticctl.train.watches.non_finite_watch import NonFiniteWatch

OK, NAN_LOSS, NAN_GRADS, NAN_BOTH, UNCHECKED = (RankFindings(True, True), RankFindings(False, True),
                                                RankFindings(True, False), RankFindings(False, False),
                                                RankFindings(None, None))


# -- the rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("reports", "loss_ranks", "gradient_ranks", "ranks"), [
    pytest.param([OK, OK], (), (), (), id="no-rank-produced-them-the-sum-overflowed"),
    pytest.param([OK, NAN_GRADS], (), (1,), (1,), id="one-rank-s-gradients"),
    pytest.param([NAN_BOTH, OK, OK], (0,), (0,), (0,), id="rank-0-s-loss-and-its-gradients"),
    pytest.param([NAN_LOSS, OK], (0,), (), (0,), id="a-loss-alone"),
    pytest.param([OK, NAN_GRADS, NAN_BOTH], (2,), (1, 2), (1, 2), id="two-ranks"),
    pytest.param([UNCHECKED, NAN_GRADS], (), (1,), (1,), id="an-unchecked-rank-is-not-named"),
    pytest.param([UNCHECKED, UNCHECKED], (), (), (), id="nothing-checked-nobody-named"),
])
def test_the_ranks_whose_own_values_were_not_finite_are_named(reports, loss_ranks, gradient_ranks, ranks):
    found = judge_non_finite(7, reports)
    assert found == NonFinite(7, loss_ranks, gradient_ranks)
    assert found.ranks == ranks


def test_what_a_rank_produced_reads_as_words():
    found = NonFinite(3, loss_ranks=(0,), gradient_ranks=(0, 1))
    assert (found.what(0), found.what(1), found.what(2)) == ("loss and gradients", "gradients", "")


@pytest.mark.parametrize(("step", "last", "first"), [
    (10, None, True),   # the run's first non-finite step
    (11, 10, False),    # the next one: the same run
    (12, 10, True),     # a finite step between: a new run
    (10, 10, True),     # a step trained again (a generation re-formed): reported again
])
def test_a_run_of_non_finite_steps_is_reported_at_its_first(step, last, first):
    assert starts_a_run(step, last) is first


@pytest.mark.parametrize(("finding", "sent"), [(OK, (1, 1)), (NAN_BOTH, (0, 0)), (UNCHECKED, (-1, -1)),
                                               (NAN_LOSS, (0, 1))])
def test_a_finding_travels_as_two_integers(finding, sent):
    assert finding.encode() == sent and RankFindings.decode(list(sent)) == finding


@given(st.lists(st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=3), st.none()), max_size=4))
def test_any_peer_report_decodes_to_a_finding_and_never_names_a_rank_for_junk(values):
    found = RankFindings.decode(values)
    for value, finite in zip(values, (found.loss, found.gradients)):
        if finite is not None:
            assert type(value) is int and value in (0, 1) and finite is (value == 1)
    if len(values) != 2:
        assert found == UNCHECKED


# -- the checks, on the device -------------------------------------------------------------------

@pytest.mark.parametrize(("values", "finite"), [
    ([1.0, -2.0, 3.0], True),
    ([1.0, math.nan, 3.0], False),
    ([math.inf, 1.0], False),
    ([1.0, -math.inf], False),
    ([3.4e38, 3.4e38], True),  # huge but finite: a min/max never overflows where a sum would
    ([], True),
])
def test_finite_flag(values, finite):
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        tensor = torch.tensor(values, dtype=dtype)
        if dtype is torch.bfloat16 and values == [3.4e38, 3.4e38]:
            continue  # above bfloat16's range
        assert bool(finite_flag(tensor)) is finite, dtype


def test_gradients_finite_reads_every_gradient_and_skips_parameters_without_one():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    assert gradients_finite(model.parameters())  # no gradient yet
    model(torch.ones(1, 2)).sum().backward()
    assert gradients_finite(model.parameters())
    model[1].bias.grad[0] = math.nan
    assert not gradients_finite(model.parameters())


@pytest.mark.parametrize(("bad", "finite"), [
    (None, True),
    (math.nan, False),
    (math.inf, False),
    (-math.inf, False),
    (3.0e38, True),  # huge but finite: the largest magnitude, no sum of squares to overflow
])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float64,),
                                    (torch.float32, torch.bfloat16)])  # mixed: torch groups them by dtype
def test_gradients_norm_reads_every_gradient_of_every_dtype_in_one_pass(bad, finite, dtypes):
    parameters = []
    for index in range(6):
        dtype = dtypes[index % len(dtypes)]
        parameter = nn.Parameter(torch.zeros(3, 5, dtype=dtype))
        parameter.grad = torch.randn(3, 5).to(dtype)
        parameters.append(parameter)
    parameters.append(nn.Parameter(torch.zeros(2)))  # no gradient: not read
    if bad is not None:
        parameters[4].grad[2, 3] = bad  # 3.0e38 is within bfloat16's range too (float32's exponent)
    norm = gradients_norm(parameters)
    assert norm is not None and norm.dim() == 0
    assert read_flags(norm, ())[0] is finite


def test_gradients_norm_of_no_gradient_is_none_and_reads_as_finite():
    assert gradients_norm([nn.Parameter(torch.zeros(2))]) is None
    assert read_flags(None, ()) == (True, None)


@pytest.mark.parametrize(("applied", "own", "expected"), [
    (1.0, (), (True, None)),
    (math.nan, (), (False, None)),
    (1.0, (True, True), (True, True)),
    (math.inf, (True, False), (False, False)),
    (math.inf, (True, True), (False, True)),  # a sum that overflowed: no rank's own values were bad
    (None, (False,), (True, False)),
])
def test_read_flags_brings_both_answers_in_one_read(applied, own, expected):
    norm = None if applied is None else torch.tensor(applied)
    flags = [torch.tensor(flag) for flag in own]
    assert read_flags(norm, flags) == expected


# -- the settings ---------------------------------------------------------------------------------

def test_the_default_names_and_applies_and_the_flag_skips():
    assert NonFiniteSettings.of(parse_rdzv_options({})) == NonFiniteSettings(check=1, skip=0)
    assert NonFiniteSettings.of(parse_rdzv_options({"check_non_finite": "0"})) == NonFiniteSettings(check=0, skip=0)
    settings_ = WorkerSettings.of(parse_rdzv_options({"skip_non_finite": "1"}), 1, 2)
    assert settings_.non_finite == NonFiniteSettings(skip=1)
    assert WorkerSettings.from_json(settings_.to_json()) == settings_


@pytest.mark.parametrize("value", ["2", "-1", "yes", "1.0"])
def test_a_bad_skip_value_is_one_sentence_naming_it(value):
    with pytest.raises(ConfigError) as caught:
        parse_rdzv_options({"skip_non_finite": value})
    message = str(caught.value)
    assert f"skip_non_finite (--skip-non-finite) ('{value}') must be a whole number from 0 to 1." in message
    assert "\n" not in message


def test_skipping_without_the_check_is_one_sentence():
    message = "skip_non_finite 1 (--skip-non-finite) needs the check it acts on: not with check_non_finite 0"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rdzv_options({"skip_non_finite": "1", "check_non_finite": "0"})
    with pytest.raises(ConfigError, match="needs the check it acts on"):
        NonFiniteSettings(check=0, skip=1)


def test_with_the_check_off_the_watch_does_nothing():
    events: list = []
    watch = collecting(NonFiniteWatch(NonFiniteSettings(check=0), "a.0", "a", enabled=True,
                                      control_group=lambda: None), events, kinds_only=True)
    group = _group()
    _backward(group.model, poison=True)
    assert watch.bucket_observer() is None
    assert watch.before_step(group, 3, math.nan, group.model.parameters(), sharded=False) is True and events == []


def test_up_hands_the_flag_to_the_rendezvous_options():
    code, stdout, stderr = up_dry_run_in_process("--skip-non-finite", "1")
    assert code == 0, stderr
    conf = dict(item.split("=", 1) for item in stdout.split("--rdzv-conf=")[1].split()[0].split(","))
    assert conf["skip_non_finite"] == "1"


def test_the_event_round_trips():
    event = Event(time=100.0, kind=EventKind.NON_FINITE, node="b", step=10, world_size=2,
                  reason="rank 1's gradients were not finite before the all-reduce; the step was skipped")
    assert Event.from_json(event.to_json().encode()) == event


# -- the one DDP hook -------------------------------------------------------------------------------

def test_every_observer_sees_each_bucket_before_the_all_reduce_and_the_gradients_are_ddp_s(process_group):
    torch.manual_seed(0)
    plain, seen = nn.Linear(4, 2), {"first": [], "second": []}
    wrapped = observe_buckets(torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 2)),
                              (lambda b: seen["first"].append(b.clone()), None,
                               lambda b: seen["second"].append(b.clone())))
    wrapped.module.load_state_dict(plain.state_dict())
    # A NaN made in a gradient as the backward computes it is in the bucket the observers see
    handle = wrapped.module.weight.register_hook(lambda g: g * math.nan)
    wrapped(torch.ones(3, 4)).sum().backward()
    handle.remove()
    assert len(seen["first"]) >= 1 and len(seen["first"]) == len(seen["second"])
    assert not all(bool(finite_flag(b)) for b in seen["first"])
    # Without the NaN: the hook's all-reduce gives what a world of one computes without DDP
    wrapped.zero_grad()
    wrapped(torch.ones(3, 4)).sum().backward()
    plain(torch.ones(3, 4)).sum().backward()
    assert torch.equal(wrapped.module.weight.grad, plain.weight.grad)


def test_a_model_that_is_not_ddp_or_no_observer_gets_no_hook():
    model = nn.Linear(2, 2)
    assert observe_buckets(model, (lambda b: None,)) is model


# -- the watch, in a world of one ------------------------------------------------------------------

def _group() -> Group:
    return Group(number=1, rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), model=nn.Linear(2, 1))


def _watch(skip: int, events: list, enabled: bool = True) -> NonFiniteWatch:
    return collecting(NonFiniteWatch(NonFiniteSettings(skip=skip), "a.0", "a", enabled=enabled,
                                     control_group=lambda: None), events)


def _backward(model: nn.Module, poison: bool) -> None:
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    if poison:
        model.bias.grad[0] = math.inf


@pytest.mark.parametrize(("skip", "applies"), [(0, True), (1, False)])
def test_a_non_finite_step_is_named_once_per_run_and_skipped_only_when_asked(skip, applies):
    events: list = []
    watch, group = _watch(skip, events), _group()
    model = group.model
    _backward(model, poison=False)
    assert watch.before_step(group, 4, 0.5, model.parameters(), sharded=False) is True
    for step in (5, 6):  # a run of two non-finite steps: one event
        _backward(model, poison=True)
        assert watch.before_step(group, step, 0.5, model.parameters(), sharded=False) is applies
    _backward(model, poison=False)
    assert watch.before_step(group, 7, 0.5, model.parameters(), sharded=False) is True
    assert [(kind, fields["node"], fields["step"]) for kind, fields in events] == [(EventKind.NON_FINITE, "a", 5)]
    assert "rank 0's gradients were not finite" in events[0][1]["reason"]
    assert ("skipped" if skip else "applied") in events[0][1]["reason"]
    assert watch.non_finite_steps == 2 and watch.last_non_finite == 6


def test_a_non_finite_loss_with_finite_gradients_is_this_worker_s_own_word():
    events: list = []
    watch, group = _watch(1, events), _group()
    _backward(group.model, poison=False)
    for step in (3, 4):  # a run of two: one event
        assert watch.before_step(group, step, math.nan, group.model.parameters(), sharded=False) is True
    assert len(events) == 1 and "rank 0's loss was not finite, its gradients were" in events[0][1]["reason"]


def test_with_a_grad_scaler_the_watch_is_off():
    events: list = []
    watch, group = _watch(1, events, enabled=False), _group()
    _backward(group.model, poison=True)
    assert watch.bucket_observer() is None
    assert watch.before_step(group, 3, math.nan, group.model.parameters(), sharded=False) is True
    assert events == []


@pytest.mark.parametrize(("loss", "named"), [(torch.tensor(math.nan), True), (torch.tensor([1.0, 2.0]), False),
                                             ("0.5", False), (object(), False), (math.inf, True)])
def test_a_loss_of_any_type_is_read_as_one_number_or_not_at_all(loss, named):
    events: list = []
    watch, group = _watch(0, events), _group()
    _backward(group.model, poison=False)
    assert watch.before_step(group, 3, loss, group.model.parameters(), sharded=False) is True
    assert bool(events) is named
