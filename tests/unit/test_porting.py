"""What a worker checks in a script written for another launcher (elasticctl/train/porting.py):
the pure decisions, table-tested, and the two checks wired to torch in this process (no launcher:
torch.multiprocessing's names and the global forward hook are restored after each test).
The scripts themselves run under real `elasticctl up` in tests/process/test_porting.py."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.modules import module as torch_module

from elasticctl.job.records import Event, EventKind
from elasticctl.train import entry, porting

LAUNCHED = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}


@pytest.mark.parametrize(("environ", "launched"), [
    (LAUNCHED, True),
    ({"RANK": "0", "WORLD_SIZE": "1"}, True),   # a world of one that may grow is still launched
    ({"LOCAL_RANK": "0"}, False),               # the entry run by hand
    ({"RANK": "0"}, False),
    ({}, False),
])
def test_launched(environ, launched):
    assert porting.launched(environ) is launched


@pytest.mark.parametrize(("function", "environ", "refused"), [
    ("spawn", LAUNCHED, True),
    ("start_processes", LAUNCHED, True),
    ("spawn", {"LOCAL_RANK": "0"}, False),
    ("start_processes", {}, False),
])
def test_spawn_refusal(function, environ, refused):
    reason = porting.spawn_refusal(function, environ)
    if not refused:
        assert reason is None
        return
    assert reason.startswith(f"this script calls torch.multiprocessing.{function}, ")
    assert 'init_method="env://"' in reason and "RANK, WORLD_SIZE, LOCAL_RANK" in reason
    assert reason.endswith(".") and reason.count(". ") == 0, "one sentence"


class MyDataParallel(nn.DataParallel):
    pass


@pytest.mark.parametrize(("make", "environ", "warned"), [
    (lambda: nn.DataParallel(nn.Linear(2, 1)), LAUNCHED, True),
    (lambda: MyDataParallel(nn.Linear(2, 1)), LAUNCHED, True),
    (lambda: nn.DataParallel(nn.Linear(2, 1)), {}, False),  # python script.py: one process, as meant
    (lambda: nn.Linear(2, 1), LAUNCHED, False),
    (lambda: nn.Sequential(nn.Linear(2, 1)), LAUNCHED, False),
])
def test_data_parallel_warning(make, environ, warned):
    text = porting.data_parallel_warning(make(), environ)
    if not warned:
        assert text is None
        return
    assert text.startswith("nn.DataParallel only splits each batch over this process's GPUs")
    assert "torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])" in text
    assert text.endswith(".") and text.count(". ") == 0, "one sentence"


@pytest.fixture
def torch_restored(monkeypatch, tmp_path):
    """torch.multiprocessing's public names as they were after the test, and this worker's marks
    in ``tmp_path``."""
    for name in porting.SPAWN_FUNCTIONS:
        monkeypatch.setattr(mp, name, getattr(mp, name))
    monkeypatch.setattr(entry, "_marks_dir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    before = dict(torch_module._global_forward_pre_hooks)
    yield tmp_path
    assert dict(torch_module._global_forward_pre_hooks) == before, "a global forward hook was left behind"


@pytest.mark.parametrize("name", porting.SPAWN_FUNCTIONS)
def test_a_launched_worker_that_spawns_exits_1_with_the_sentence_and_marks_itself_unrecoverable(
        torch_restored, capsys, name):
    porting.refuse_spawn(LAUNCHED, entry.note_unrecoverable)  # as the worker entry installs it
    with pytest.raises(SystemExit) as exited:
        getattr(mp, name)(print, nprocs=2)
    assert exited.value.code == 1
    reason = porting.spawn_refusal(name, LAUNCHED)
    assert capsys.readouterr().err == f"elasticctl: error: T{reason[1:]}\n"
    assert (torch_restored / "unrecoverable-0").read_text() == reason


def test_outside_a_launched_world_spawn_is_torchs(torch_restored):
    original = mp.spawn
    porting.refuse_spawn({})
    assert mp.spawn is not original and mp.spawn.__wrapped__ is original  # guarded, but it lets the call through
    assert porting.spawn_refusal("spawn", {}) is None


def test_nothing_is_installed_outside_a_launched_world(torch_restored):
    spawn, start_processes = mp.spawn, mp.start_processes
    porting.install({"LOCAL_RANK": "0"})
    assert (mp.spawn, mp.start_processes) == (spawn, start_processes)


def test_the_first_forward_of_data_parallel_warns_once_and_the_hook_goes(torch_restored, capsys):
    recorded = []
    porting.warn_on_data_parallel(LAUNCHED, record=recorded.append)
    model = nn.DataParallel(nn.Linear(2, 1))
    model(torch.ones(3, 2))
    model(torch.ones(3, 2))
    text = porting.data_parallel_warning(model, LAUNCHED)
    assert capsys.readouterr().err == f"elasticctl: warning: {text}\n"
    assert recorded == [text]


def test_a_first_forward_of_another_model_says_nothing_and_the_hook_goes(torch_restored, capsys):
    recorded = []
    porting.warn_on_data_parallel(LAUNCHED, record=recorded.append)
    nn.Linear(2, 1)(torch.ones(3, 2))
    nn.DataParallel(nn.Linear(2, 1))(torch.ones(3, 2))  # later: the hook is gone (and it never looks again)
    assert capsys.readouterr().err == "" and recorded == []


def test_the_warning_is_an_event_of_the_history():
    text = porting.data_parallel_warning(nn.DataParallel(nn.Linear(2, 1)), LAUNCHED)
    event = Event(time=1.0, kind=EventKind.SCRIPT_WARNING, node="a", reason=text)
    assert Event.from_json(event.to_json().encode()) == event


def test_the_checks_wait_for_the_scripts_own_import_of_torch():
    # A script may set what torch reads at import before it imports torch: that must still work
    # under elasticctl, so installing the checks imports nothing; they arrive with torch.
    code = textwrap.dedent("""
        import os, sys
        from elasticctl.train import porting
        porting.install({"RANK": "0", "WORLD_SIZE": "2"})
        assert "torch" not in sys.modules, "installing the checks imported torch"
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch, torch.multiprocessing as mp
        print(torch.get_num_threads(), hasattr(mp.spawn, "__wrapped__"),
              any(type(f).__name__ == "_AfterTorchLoads" for f in sys.meta_path))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True", "False"], result.stdout


# -- torch's DistributedSampler built before any process group ------------------------------------

NO_GROUP = ValueError("Default process group has not been initialized, please make sure to call "
                      "init_process_group.")
SAMPLER_INIT = ("/venv/site-packages/torch/utils/data/distributed.py", "__init__")
GET_WORLD = ("/venv/site-packages/torch/distributed/distributed_c10d.py", "get_world_size")


@pytest.mark.parametrize(("error", "frames", "fixed"), [
    (NO_GROUP, [("/job/train.py", "<module>"), SAMPLER_INIT, GET_WORLD], True),
    (NO_GROUP, [("/job/train.py", "main"), SAMPLER_INIT, GET_WORLD], True),
    # the same error from elsewhere (a collective before init_process_group): torch's words stand
    (NO_GROUP, [("/job/train.py", "<module>"), GET_WORLD], False),
    (ValueError("Invalid rank 3, rank should be in the interval [0, 1]"), [("/job/train.py", "<module>"),
                                                                          SAMPLER_INIT], False),
    (KeyError("x"), [SAMPLER_INIT], False),
])
def test_sampler_before_group(error, frames, fixed):
    reason = porting.sampler_before_group(error, frames)
    if not fixed:
        assert reason is None
        return
    assert reason.startswith("this script builds torch's DistributedSampler before any process group exists")
    assert "use elastic.ResumableSampler(dataset)" in reason
    assert reason.endswith(".") and reason.count(". ") == 0, "one sentence"


def test_a_distributed_sampler_at_module_level_ends_the_worker_with_the_fix(torch_restored, capsys):
    script = torch_restored / "train.py"
    script.write_text("from torch.utils.data import DistributedSampler\n"
                      "sampler = DistributedSampler(list(range(10)))\n")
    with pytest.raises(ValueError) as raised:  # torch's, as the script raises it
        runpy.run_path(str(script), run_name="__main__")
    with pytest.raises(SystemExit) as exited:
        entry._refuse_sampler_before_group(raised.value)
    assert exited.value.code == 1
    reason = (torch_restored / "unrecoverable-0").read_text()
    assert reason.startswith("this script builds torch's DistributedSampler")
    assert capsys.readouterr().err == f"elasticctl: error: T{reason[1:]}\n"


def test_another_error_goes_on_as_the_script_raised_it(torch_restored, capsys):
    entry._refuse_sampler_before_group(KeyError("x"))
    assert capsys.readouterr().err == "" and not (torch_restored / "unrecoverable-0").exists()
