"""What a worker whose script raised tells its node (elasticctl/job/worker_failure.py): the record
read back is validated, the place is the script's own line, and the worker entry writes it."""

from __future__ import annotations

import json
import runpy
import textwrap

import pytest

from elasticctl.job.worker_failure import (MAX_BYTES, WorkerFailure, failure_site, one_line,
                                           peers_involved)
from elasticctl.train import entry

GOOD = {"kind": "ZeroDivisionError", "message": "division by zero", "file": "/job/train.py", "line": 3,
        "in_script": True, "trained": False}


def test_a_record_round_trips():
    record = WorkerFailure(**GOOD)
    assert WorkerFailure.parse(record.to_json()) == record


@pytest.mark.parametrize("text", [
    "",
    "not json",
    "[1, 2]",
    json.dumps({**GOOD, "line": "3"}),          # a line that is no number
    json.dumps({**GOOD, "line": True}),         # a bool is no line
    json.dumps({**GOOD, "line": -1}),
    json.dumps({**GOOD, "trained": 0}),         # a flag must be a bool
    json.dumps({**GOOD, "in_script": "yes"}),
    json.dumps({k: v for k, v in GOOD.items() if k != "file"}),
    json.dumps({**GOOD, "kind": ""}),
    json.dumps({**GOOD, "file": ""}),
    json.dumps({**GOOD, "kind": "A" * 201}),
    json.dumps({**GOOD, "message": "m" * 301}),
    json.dumps({**GOOD, "file": "/" + "f" * 1024}),
    json.dumps({**GOOD, "message": "two\nlines"}),  # printed in the node's one line
    json.dumps({**GOOD, "file": "/job/\x1b[2Jtrain.py"}),
    json.dumps({**GOOD, "message": "x" * 200, "pad": "p" * MAX_BYTES}),  # oversized
])
def test_what_is_not_a_record_is_none(text):
    assert WorkerFailure.parse(text) is None


def test_unknown_fields_are_ignored():
    assert WorkerFailure.parse(json.dumps({**GOOD, "newer": 1})) == WorkerFailure(**GOOD)


LIB = ("/usr/lib/python3.11", "/venv/site-packages", "/src/elasticctl")


@pytest.mark.parametrize(("frames", "site"), [
    ([("/usr/lib/python3.11/runpy.py", 88), ("/job/train.py", 3)], ("/job/train.py", 3)),
    # raised in torch, called from the script: the script's line
    ([("/job/train.py", 3), ("/venv/site-packages/torch/nn/functional.py", 99)], ("/job/train.py", 3)),
    # the script's own helper module: its line, the innermost of the script's own code
    ([("/job/train.py", 3), ("/job/model.py", 12), ("/venv/site-packages/torch/x.py", 5)], ("/job/model.py", 12)),
    ([("<frozen runpy>", 88), ("/src/elasticctl/train/entry.py", 9), ("/job/train.py", 7)], ("/job/train.py", 7)),
    # a directory whose name only starts like a library's is the script's
    ([("/usr/lib/python3.11-job/train.py", 1)], ("/usr/lib/python3.11-job/train.py", 1)),
    # nothing of the script's own (a module of an installed package run with --module): the innermost
    ([("<frozen runpy>", 88), ("/venv/site-packages/pkg/main.py", 4)], ("/venv/site-packages/pkg/main.py", 4)),
    ([], None),
])
def test_failure_site(frames, site):
    assert failure_site(frames, LIB) == site


DIST, PKG = "/venv/site-packages/torch/distributed", "/src/elasticctl"


@pytest.mark.parametrize(("innermost", "distributed_error", "config_error", "involved"), [
    ("/job/train.py", False, False, False),                               # the script's own
    ("/venv/site-packages/torch/nn/functional.py", False, False, False),  # torch, not its collectives
    ("/job/train.py", True, False, True),                                 # a DistError, wherever raised
    (f"{DIST}/distributed_c10d.py", False, False, True),                  # a collective, a store
    (f"{PKG}/train/runtime.py", False, False, True),                      # elasticctl gave up (a generation)
    (f"{PKG}/train/sampler.py", False, True, False),                      # a value the script passed
])
def test_peers_involved(innermost, distributed_error, config_error, involved):
    assert peers_involved(innermost, distributed_error=distributed_error, config_error=config_error,
                          distributed_dir=DIST, package_dir=PKG) is involved


def test_one_line():
    assert one_line("a\n  b\tc\x00d") == "a b c d"
    assert one_line("x" * 400) == "x" * 297 + "..."


# -- the worker entry writes it ---------------------------------------------------------------------

@pytest.fixture
def marks(monkeypatch, tmp_path):
    """The entry's marks in ``tmp_path/marks``, with a worker that has counted no step."""
    (tmp_path / "marks").mkdir()
    monkeypatch.setattr(entry, "_marks_dir", str(tmp_path / "marks"))
    monkeypatch.setattr(entry, "_steps_counted", False)
    monkeypatch.setattr(entry, "_stepped", False)
    monkeypatch.setattr(entry, "_joined", False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    return tmp_path


def failed_with(marks, source: str, name: str = "train.py") -> WorkerFailure:
    """Run ``source`` as the entry runs a script, and return the record its failure left."""
    script = marks / name
    script.write_text(textwrap.dedent(source))
    with pytest.raises(Exception) as raised:
        runpy.run_path(str(script), run_name="__main__")
    entry._note_failure(raised.value)
    return WorkerFailure.parse((marks / "marks" / "failure-0").read_text())


def test_an_import_time_error_is_the_scripts_own_at_its_line(marks):
    record = failed_with(marks, "import os\nBROKEN = 1 / 0\n")
    assert record == WorkerFailure(kind="ZeroDivisionError", message="division by zero",
                                   file=str(marks / "train.py"), line=2, in_script=True, trained=False)


def test_a_syntax_error_is_placed_at_its_line(marks):
    record = failed_with(marks, "x = 1\ndef f(:\n")
    assert (record.kind, record.file, record.line, record.in_script) == ("SyntaxError", str(marks / "train.py"),
                                                                          2, True)


def test_an_error_in_torch_is_placed_at_the_scripts_line_that_called_it(marks):
    record = failed_with(marks, """\
        import torch
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    """)
    assert (record.kind, record.line, record.in_script) == ("RuntimeError", 2, True)


def test_a_bad_value_given_to_elasticctl_is_the_scripts_own(marks):
    record = failed_with(marks, """\
        from elasticctl.train.sampler import ResumableSampler
        sampler = ResumableSampler(range(3), num_replicas=2, rank=5)
    """)
    assert (record.kind, record.line, record.in_script) == ("ConfigError", 2, True)


@pytest.mark.parametrize("source", [
    # elasticctl's own judgement of what a peer sent
    "from elasticctl.train.state import State\nimport torch\nState(torch.nn.Linear(1, 1)).load_bytes(b'x', 'cpu')\n",
    "import torch.distributed as dist\nraise dist.DistBackendError('Connection closed by peer')\n",
])
def test_what_peers_may_have_caused_is_not_the_scripts_own(marks, source):
    assert not failed_with(marks, source).in_script


def test_after_a_committed_step_it_trained(marks):
    entry.note_steps_counted()
    assert not failed_with(marks, "raise KeyError('x')\n").trained
    entry.note_step()
    assert failed_with(marks, "raise KeyError('x')\n").trained


def test_a_script_that_counts_its_own_steps_may_have_trained_once_it_joined(marks):
    assert not failed_with(marks, "raise KeyError('x')\n").trained
    entry.note_joined()
    assert failed_with(marks, "raise KeyError('x')\n").trained
