"""Bad input meets one sentence: `elasticctl: error: ...` naming the value, a non-zero exit,
no traceback, nothing left in etcd and nothing left running.

Each test runs the real CLI (a subprocess) against a real etcd on loopback, except the
property tests, which call the CLI's entry point in this process.

Layer tests/unit: no etcd, no processes. The other tests of this subject:
tests/process/test_bad_input.py.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml
from support.helpers import MLP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.job.spec import JobSpec, validate_name


# -- 5: one naming rule for job names, run ids and node ids ----------------------------------------

@given(st.text(max_size=80))
def test_validate_name_accepts_only_key_safe_names(value):
    try:
        assert validate_name(value, "run id") == value
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith("The run id ") and "\n" not in message
        return
    assert 1 <= len(value) <= 63 and value[0].isascii() and value[0].isalnum()
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in value)


def test_validate_name_refuses_a_trailing_newline():
    with pytest.raises(ConfigError, match=r"^The node id 'abc\\n' must be 1-63 letters"):
        validate_name("abc\n", "node id")
    assert validate_name("job-1.a_b", "job name") == "job-1.a_b"


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_job_keys = ["args", "env", "rdzv_conf", "nnodes", "job", "nproc-per-node", "max_restarts",
             "node-ttl", "legacy_local_rank", "module", "checkpoint_dir", "node_id", "etcd_port",
             "local_addr"]


def _run_in_process(argv: list[str]) -> tuple[int, str]:
    """The CLI's entry point in this process: (exit code, stderr)."""
    from elasticctl.cli import main

    stderr, stdout = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, stderr.getvalue()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job_file=st.dictionaries(st.sampled_from(_job_keys), _values, max_size=4))
def test_any_job_file_gives_a_command_or_one_sentence(tmp_path, job_file):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_file))
    # Any exception other than SystemExit escapes and fails the test: a traceback for the user.
    code, stderr = _run_in_process(["up", "--dry-run", "--nnodes", "1", "--config", str(config),
                                    MLP])
    lines = stderr.strip().splitlines()
    prefixes = ("elasticctl: error: ", "elasticctl: warning: ")
    assert all(line.startswith(prefixes) for line in lines), stderr
    errors = [line for line in lines if line.startswith("elasticctl: error: ")]
    assert len(errors) == (1 if code else 0), stderr


# -- 10: node-ttl, and an `up` that fails after publishing -----------------------------------------

@pytest.mark.parametrize("ttl", [1, 3601, 9999999999, 99999999999999999999])
def test_node_ttl_is_bounded_in_the_spec(ttl):
    message = rf"^The node liveness TTL \({ttl} s\) must be between 2 and 3600 seconds\.$"
    with pytest.raises(ConfigError, match=message):
        JobSpec(name="job", script="train.py", node_ttl=ttl)


# -- issue 23, item 7: numbers are ASCII digits ---------------------------------------------------

@pytest.mark.parametrize(
    ("text", "number"),
    [("0", 0), ("80", 80), ("65535", 65535), ("007", 7), ("²", None), ("٨٠", None), ("８０", None),
     ("", None), (" 80", None), ("80\n", None), ("+80", None), ("-1", None), ("1_000", None),
     ("8" * 19, None)],
)
def test_whole_number_takes_ascii_digits_only(text, number):
    from elasticctl.job.spec import whole_number

    assert whole_number(text) == number
