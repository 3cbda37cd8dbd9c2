"""torchrun's command line, kept where elasticctl launches torchrun (``up``, ``join``): its
underscore spellings, its words for --nproc-per-node, its worker-log options passed through, and
an unknown option refused with a suggestion instead of being taken for the script. The pure parts;
tests/process/test_cli.py runs the commands."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from elasticctl.cli import cli
from elasticctl.cli.lifecycle import join_hint
from elasticctl.cli.options import torchrun_spellings
from elasticctl.errors import ConfigError
from elasticctl.launcher import WorkerLogs, local_world_size

OPTIONS = {"--nproc-per-node": True, "--max-restarts": True, "--dry-run": False, "--nnodes": True}


@pytest.mark.parametrize(("args", "expected"), [
    (["--nproc_per_node", "2", "train.py"], ["--nproc-per-node", "2", "train.py"]),
    (["--nproc_per_node=2", "train.py"], ["--nproc-per-node=2", "train.py"]),
    (["--dry-run", "--max_restarts", "3", "t.py", "--max_restarts", "9"],
     ["--dry-run", "--max-restarts", "3", "t.py", "--max_restarts", "9"]),  # after the script: the script's
    (["--nnodes", "--nproc_per_node", "t.py"], ["--nnodes", "--nproc_per_node", "t.py"]),  # a value, whatever it looks like
    (["--no_such_thing", "t.py"], ["--no_such_thing", "t.py"]),  # left for the parser to refuse
    (["--", "--nproc_per_node"], ["--", "--nproc_per_node"]),
    ([], []),
])
def test_torchrun_spellings_before_the_script(args, expected):
    assert torchrun_spellings(args, OPTIONS) == expected


@given(st.lists(st.sampled_from(["--nproc_per_node", "--max_restarts=1", "--dry-run", "t.py", "--x_y", "2", "--"]),
                max_size=8))
def test_spellings_only_ever_rewrite_underscores_of_known_options(args):
    out = torchrun_spellings(args, OPTIONS)
    assert len(out) == len(args)
    for before, after in zip(args, out):
        assert after == before or (after == before.replace("_", "-") and before.split("=")[0].replace("_", "-") in OPTIONS)


@pytest.mark.parametrize(("value", "gpus", "cpus", "expected"), [
    ("2", 0, 8, 2), ("2", 4, 8, 2), ("auto", 4, 8, 4), ("auto", 0, 8, 8), ("cpu", 4, 8, 8), ("gpu", 2, 8, 2),
])
def test_nproc_per_node_means_what_torchrun_means(value, gpus, cpus, expected):
    assert local_world_size(value, gpus, cpus) == expected


@pytest.mark.parametrize(("value", "gpus", "says"), [("gpu", 0, "none is visible"), ("3", 2, "exceed the 2 GPUs")])
def test_nproc_per_node_that_cannot_be_met_is_one_sentence(value, gpus, says):
    with pytest.raises(ConfigError, match=says):
        local_world_size(value, gpus, 8)


def test_worker_logs_pass_through_as_torchrun_takes_them():
    logs = WorkerLogs(log_dir="/tmp/logs", tee="3", redirects="0:3,1:2", local_ranks_filter="0,1")
    assert logs.args() == ["--log-dir=/tmp/logs", "--tee=3", "--redirects=0:3,1:2", "--local-ranks-filter=0,1"]
    assert WorkerLogs().args() == []


@pytest.mark.parametrize("field,value", [("tee", "4"), ("tee", "x"), ("redirects", "0:3,"), ("local_ranks_filter", "0,a"),
                                         ("log_dir", " ")])
def test_bad_worker_log_values_are_one_sentence_naming_them(field, value):
    with pytest.raises(ConfigError) as raised:
        WorkerLogs(**{field: value})
    assert "\n" not in str(raised.value) and (value.strip() == "" or repr(value) in str(raised.value))


def test_a_loopback_etcd_says_it_serves_this_host_only():
    lines = join_hint("127.0.0.1:2379", "127.0.0.1", "demo")
    assert "this host only" in lines[0] and lines[1] == "  elasticctl join --etcd 127.0.0.1:2379 --job demo"
    assert "--etcd-listen 0.0.0.0" in lines[2]
    assert "every other host" in join_hint("10.0.0.5:2379", "0.0.0.0", "demo")[0]


@pytest.mark.parametrize("command", ["up", "join"])
def test_an_unknown_option_is_refused_with_a_suggestion_not_taken_for_the_script(command):
    result = CliRunner().invoke(cli, [command, "--etcd", "127.0.0.1:1", "--nproc-per-nod", "2", "train.py"])
    assert result.exit_code == 2 and "No such option --nproc-per-nod." in result.output.replace("'", ""), result.output
    if command == "up":
        assert "Did you mean --nproc-per-node" in result.output.replace("'", ""), result.output


@pytest.mark.parametrize(("low", "high", "checkpoint_dir", "conf", "warned"), [
    (1, 2, None, (), True),                       # restart mode, can change size, no checkpoints: warned
    (2, 2, None, (), False),                      # a fixed size never restarts for a membership change
    (1, 2, "/shared/ckpt", (), False),
    (1, 2, None, (("recovery", "hot"),), False),  # hot mode keeps the state in memory
])
def test_a_restart_mode_job_that_can_change_size_without_checkpoints_is_warned(low, high, checkpoint_dir, conf,
                                                                                 warned):
    from elasticctl.cli.lifecycle import no_checkpoint_warning
    from elasticctl.job.spec import JobSpec

    spec = JobSpec(name="demo", script="train.py", min_nodes=low, max_nodes=high, checkpoint_dir=checkpoint_dir,
                   rdzv_conf=conf)
    warning = no_checkpoint_warning(spec)
    assert (warning is not None) is warned
    if warned:
        assert "step 0" in warning and "--checkpoint-dir" in warning and "\n" not in warning
