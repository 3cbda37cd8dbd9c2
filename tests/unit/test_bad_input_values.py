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
import math
import sys

import pytest
import yaml
from support.helpers import MLP
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.job import environment
from elasticctl.job.settings import parse_rdzv_options
from elasticctl.job.spec import JobSpec, validate_name
from elasticctl.numbers import decimal_number, integer, whole_number
from elasticctl.train import entry


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
             "local_addr", "spares", "straggler-ratio", "straggler_window", "straggler-interval",
             "evict_stragglers", "key-prefix"]


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
@example(job_file={"rdzv_conf": "0\r0"})  # a carriage return in a value named by the error: one line all the same
@example(job_file={"nnodes": "1\n:2"})
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


# -- numbers are ASCII digits ---------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "number"),
    [("0", 0), ("80", 80), ("65535", 65535), ("007", 7), ("²", None), ("٨٠", None), ("８０", None),
     ("", None), (" 80", None), ("80\n", None), ("+80", None), ("-1", None), ("1_000", None),
     ("8" * 19, None)],
)
def test_whole_number_takes_ascii_digits_only(text, number):
    from elasticctl.job.spec import whole_number

    assert whole_number(text) == number


# -- one strict reading of numbers: ASCII only, for every flag, option and setting -----------------

@pytest.mark.parametrize(
    ("text", "number"),
    [("1.5", 1.5), ("2", 2.0), ("0", 0.0), (".5", 0.5), ("5.", 5.0), ("-3", -3.0), ("+1.5", 1.5),
     ("1e3", 1000.0), ("1e-05", 1e-05), ("1e+20", 1e20),
     ("1_5", None), ("1_000.5", None), ("１.５", None), ("٣", None), ("²", None), ("1.٥", None),
     ("nan", None), ("inf", None), ("-inf", None), ("1e999", None), ("", None), (" 1.5", None),
     ("1.5\n", None), ("1,5", None), ("0x10", None), ("1e", None), (".", None), ("--1", None),
     ("9" * 19, None), ("9" * 5000, None)],
)
def test_decimal_number_takes_ascii_forms_only(text, number):
    assert decimal_number(text) == number


@pytest.mark.parametrize(
    ("text", "number"),
    [("0", 0), ("-1", -1), ("+7", 7), ("9" * 20, int("9" * 20)), ("1_0", None), ("３", None),
     ("٣", None), ("", None), ("-", None), (" 1", None), ("1.0", None), ("9" * 4301, None)],
)
def test_integer_takes_ascii_digits_with_a_sign_and_any_length_int_reads(text, number):
    # What flags' ranges are checked on: a number far out of range is named as that, not as no number.
    assert integer(text) == number


# Every rendezvous option that is a number, and forms int() or float() read but no one types.
NUMERIC_OPTIONS = ["read_timeout", "retry_timeout", "connect_timeout", "ttl", "node_ttl", "max_restarts",
                   "quarantine_after", "quarantine_window", "quarantine_seconds", "join_timeout",
                   "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
                   "keep_alive_max_attempt", "straggler_ratio", "straggler_window", "straggler_interval",
                   "evict_stragglers", "spares"]
NOT_ASCII_NUMBERS = ["1_5", "3_0", "１.５", "３", "٣", "²", "nan", "1e999", "9" * 5000, "1 5"]


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS)
@pytest.mark.parametrize("key", NUMERIC_OPTIONS)
def test_every_numeric_rendezvous_option_refuses_what_is_not_an_ascii_number(key, text):
    with pytest.raises(ConfigError) as caught:
        parse_rdzv_options({key: text})
    message = str(caught.value)
    assert message.startswith(f"The rendezvous option {key} ") and text[:50] in message, message
    assert "\n" not in message


@pytest.mark.parametrize(("key", "text", "value"), [
    ("straggler_ratio", "1.5", 1.5), ("straggler_ratio", "2", 2.0), ("evict_stragglers", "0", 0.0),
    ("evict_stragglers", "3.25", 3.25), ("spares", "0", 0), ("spares", "2", 2),
    ("read_timeout", "1e1", 10.0), ("quarantine_seconds", "0.5", 0.5), ("ttl", "007", 7),
])
def test_ascii_numbers_still_pass(key, text, value):
    assert getattr(parse_rdzv_options({key: text}), key) == value


@pytest.mark.parametrize("key", [*NUMERIC_OPTIONS, "recovery", "secret", "key_prefix", "protocol"])
@pytest.mark.parametrize("empty", ["", "  "])
def test_a_spec_refuses_an_empty_rendezvous_option(key, empty):
    # torchrun refuses `key=` in its --rdzv-conf: such a spec must never be published.
    with pytest.raises(ConfigError, match=rf"^The rendezvous option '{key}' is empty; "):
        JobSpec(name="job", script="train.py", rdzv_conf=((key, empty),))


FUZZ = settings(max_examples=300, deadline=None)


@FUZZ
@given(st.text(max_size=40))
def test_any_text_is_an_ascii_whole_number_or_none(text):
    number = whole_number(text)
    if number is not None:
        assert text.isascii() and text.isdigit() and number == int(text) and 0 <= number < 10**18


@FUZZ
@given(st.text(max_size=40) | st.from_regex(r"[-+]?[0-9_]{0,6}(\.[0-9_]{0,4})?([eE][-+]?[0-9]{1,4})?",
                                                fullmatch=True))
def test_any_text_is_an_ascii_finite_number_or_none(text):
    number = decimal_number(text)
    if number is not None:
        assert text.isascii() and "_" not in text and text.strip() == text
        assert math.isfinite(number) and number == float(text)


@FUZZ
@given(st.integers(0, 10**18 - 1), st.floats(allow_nan=False, allow_infinity=False))
@example(0, 0.0032208093663442087)  # the longest fraction str() writes: 3 zeros, 17 digits
@example(10**18 - 1, 1e16 - 2)  # the longest whole part before str() turns to an exponent
def test_what_python_writes_reads_back(whole, real):
    # str() of a float is how a YAML float and an encoded setting arrive: every finite one reads back.
    assert whole_number(str(whole)) == whole
    assert decimal_number(str(real)) == real


@FUZZ
@given(st.text(st.characters(categories=("Nd", "No")), min_size=1, max_size=6).filter(lambda t: not t.isascii()))
def test_digits_of_other_scripts_are_no_number(text):
    assert whole_number(text) is None and decimal_number(text) is None


@FUZZ
@given(key=st.sampled_from(NUMERIC_OPTIONS), text=st.text(max_size=12) | st.sampled_from(NOT_ASCII_NUMBERS))
def test_a_numeric_option_from_untrusted_text_is_ascii_or_one_sentence(key, text):
    try:
        options = parse_rdzv_options({key: text})
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    given_text = text.strip()
    assert given_text == "" or (given_text.isascii() and "_" not in given_text), (key, text, options)


# -- the flags of `up` and `join`: every value checked before anything is published ----------------

@pytest.mark.parametrize(("args", "needles"), [
    (["--spares", ""], ["'--spares'", "it is empty"]),
    (["--evict-stragglers", ""], ["'--evict-stragglers'", "it is empty"]),
    (["--straggler-ratio", " "], ["'--straggler-ratio'", "it is empty"]),
    (["--straggler-window", ""], ["'--straggler-window'", "it is empty"]),
    (["--straggler-interval", ""], ["'--straggler-interval'", "it is empty"]),
    (["--straggler-ratio", "1_5"], ["(--straggler-ratio) ('1_5') must be a ratio"]),
    (["--straggler-ratio", "１.５"], ["(--straggler-ratio) ('１.５') must be a ratio"]),
    (["--evict-stragglers", "３"], ["(--evict-stragglers) ('３') must be a ratio"]),
    (["--evict-stragglers", "1_5"], ["(--evict-stragglers) ('1_5')"]),
    (["--spares", "1_0"], ["(--spares) ('1_0') must be a whole number"]),
    (["--spares", "２"], ["(--spares) ('２')"]),
    (["--straggler-window", "2_0"], ["(--straggler-window) ('2_0')"]),
    (["--straggler-interval", "５"], ["(--straggler-interval) ('５')"]),
    (["--max-restarts", "1_0"], ["'--max-restarts'", "'1_0'"]),
    (["--node-ttl", "１０"], ["'--node-ttl'", "'１０'"]),
    (["--node-ttl", "9" * 20], ["(" + "9" * 20 + " s) must be between 2 and 3600 seconds"]),
    (["--etcd-port", "2_379"], ["'--etcd-port'", "'2_379'"]),
    (["--nnodes", "1_0"], ["'1_0'"]),
    (["--nproc-per-node", "1_0"], ["'1_0'"]),
    (["--checkpoint-dir", ""], ["'--checkpoint-dir'", "it is empty"]),
    (["--local-addr", ""], ["'--local-addr'", "it is empty"]),
    (["--etcd-data-dir", ""], ["'--etcd-data-dir'", "it is empty"]),
    (["--etcd", ""], ["'--etcd'", "it is empty"]),
    (["--etcd-cacert", ""], ["'--etcd-cacert'", "it is empty"]),
    (["--key-prefix", ""], ["'--key-prefix'", "the etcd key prefix ('')"]),
    (["--key-prefix", "jobs"], ["'--key-prefix'", "('jobs')"]),
    (["--rdzv-conf", "spares="], ["The rendezvous option 'spares' is empty"]),
    (["--rdzv-conf", "evict_stragglers= "], ["The rendezvous option 'evict_stragglers' is empty"]),
    (["--rdzv-conf", "straggler_ratio=1_5"], ["straggler_ratio (--straggler-ratio) ('1_5')"]),
    (["--rdzv-conf", "read_timeout=１"], ["read_timeout ('１')"]),
    (["--rdzv-conf", "ttl=" + "9" * 5000], ["The rendezvous option ttl ("]),
])
def test_a_bad_up_flag_is_one_sentence_naming_it(args, needles):
    # A flag given twice takes its last value: `--nnodes 1_0` after `--nnodes 1` is the one read.
    code, stderr = _run_in_process(["up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1", *args, MLP])
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("elasticctl: error: "), stderr
    for needle in needles:
        assert needle in lines[0], stderr


@pytest.mark.parametrize(("args", "needle"), [
    (["join", "--wait", "1_5"], "'1_5'"),
    (["join", "--wait", "１"], "'１'"),
    (["join", "--local-addr", ""], "'--local-addr'"),
    (["join", "--etcd", ""], "'--etcd'"),
    (["join", "--key-prefix", ""], "'--key-prefix'"),
    (["down", "--timeout", "1_0"], "'1_0'"),
    (["leave", "--timeout", "٣"], "'٣'"),
])
def test_a_bad_join_flag_is_one_sentence_before_etcd_is_reached(args, needle):
    # The etcd address is one where nothing listens: a flag checked first never gets there.
    etcd = [] if "--etcd" in args else ["--etcd", "127.0.0.1:1"]
    code, stderr = _run_in_process([args[0], *etcd, *args[1:]])
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and needle in lines[0], stderr


@pytest.mark.parametrize(("content", "needle"), [
    ("spares: ''\n", "'--spares'"),
    ("straggler_ratio: '1_5'\n", "('1_5')"),
    ("evict-stragglers: '３'\n", "('３')"),
    ("rdzv_conf: {spares: ''}\n", "The rendezvous option 'spares' is empty"),
    ("rdzv_conf: {straggler_window: 1_0}\n", "('1_0')"),
])
def test_a_job_file_value_is_read_as_strictly_as_a_flag(tmp_path, content, needle):
    config = tmp_path / "job.yaml"
    config.write_text(content, encoding="utf-8")
    code, stderr = _run_in_process(["up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1",
                                    "--config", str(config), MLP])
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and needle in lines[0], stderr


# -- a script that refuses its own arguments is not restarted -------------------------------------

@pytest.mark.parametrize(("exit_code", "joined", "refused"), [
    (2, False, True),      # argparse's parser.error before the script formed its group
    (2, True, False),      # a 2 while training: judged as any failure
    (1, False, False),     # an exception, or sys.exit(1): judged as any failure
    (0, False, False),     # finished (--help)
    (None, False, False),  # sys.exit() alone: finished
    ("usage", False, False),  # sys.exit("message") exits 1
    (True, False, False),  # a bool is no status, though True == 1
    (2.0, False, False),   # sys.exit(2.0) prints 2.0 and exits 1
])
def test_which_exit_is_a_refusal_of_the_scripts_arguments(exit_code, joined, refused):
    assert entry.refused_its_arguments(exit_code, joined) is refused


_SCRIPTS = {
    "usage-error": "import argparse\n"
                   "parser = argparse.ArgumentParser()\n"
                   "parser.add_argument('--peer-copies', type=int)\n"
                   "args = parser.parse_args()\n"
                   "parser.error(f'--peer-copies ({args.peer_copies}) must be 0 or more.')\n",
    "usage-error-after-joining": "from elasticctl.train import entry\n"
                                 "entry.note_joined()\n"
                                 "raise SystemExit(2)\n",
    "failure": "raise SystemExit(1)\n",
}


@pytest.mark.parametrize(("script", "marked"), [
    ("usage-error", True), ("usage-error-after-joining", False), ("failure", False),
])
def test_the_worker_entry_marks_a_refusal_of_arguments_unrecoverable(tmp_path, monkeypatch, capsys,
                                                                     script, marked):
    marks = tmp_path / "marks"
    marks.mkdir()
    path = tmp_path / f"{script}.py"
    path.write_text(_SCRIPTS[script])
    monkeypatch.setenv(environment.WORKER_MARKS, str(marks))
    monkeypatch.setenv("LOCAL_RANK", "0")
    # entry.main runs the script in this process, as a worker runs it: keep pytest's own state.
    for name, value in (("_marks_dir", None), ("_joined", False), ("_completed", False),
                        ("_stop_requested", False)):
        monkeypatch.setattr(entry, name, value)
    monkeypatch.setattr(entry.atexit, "register", lambda callback: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as caught:
        entry.main([str(path), "--peer-copies", "-1"])
    assert caught.value.code == (2 if script.startswith("usage-error") else 1)
    unrecoverable = marks / "unrecoverable-0"
    assert unrecoverable.exists() is marked
    if marked:
        reason = unrecoverable.read_text()
        assert reason == (f"its script {path} refused its arguments (exit status 2 before it joined the "
                          "job), which every restart would repeat.")
        assert capsys.readouterr().err.count("usage:") == 1
