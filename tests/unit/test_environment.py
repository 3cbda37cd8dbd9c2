"""The worker environment's codec: what the node and its handler write, every worker reads back;
every bad value is one ConfigError sentence naming it; anything else in an environment is untrusted."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.job import environment
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.job.settings import HotSettings, StragglerSettings

FULL = WorkerEnvironment(
    node="n0", node_addr="10.0.0.7", restarts=3, marks_dir="/tmp/marks/round-2", job="demo",
    key_prefix="/team/jobs", etcd="https://e1:2379,https://e2:2379", etcd_cacert="/ca.pem",
    etcd_cert="/c.pem", etcd_key="/k.pem", etcd_user="trainer", etcd_password="pw",
    checkpoint_dir="/ckpt", rdzv_secret="s3cret", hot=HotSettings(min_nodes=1, max_nodes=4, node_ttl=7),
    stragglers=StragglerSettings(ratio=2.0, window=30, interval=5, evict=3.0, min_nodes=2))


@pytest.mark.parametrize("env", [
    WorkerEnvironment(),
    FULL,
    WorkerEnvironment(job="demo", etcd="127.0.0.1:2379"),
    WorkerEnvironment(restarts=0, marks_dir="/m"),
    WorkerEnvironment(node_addr="[fe80::1%eth0]"),
], ids=["empty", "full", "node-given", "zero-restarts", "ipv6"])
def test_round_trip(env):
    assert WorkerEnvironment.from_env(env.to_env()) == env


def test_unset_fields_are_not_written():
    assert WorkerEnvironment().to_env() == {}
    assert WorkerEnvironment(job="demo").to_env() == {environment.JOB: "demo"}


def test_every_variable_it_writes_is_a_worker_variable():
    assert set(FULL.to_env()) == set(environment.WORKER_VARIABLES)
    assert all(name.startswith("ELASTICCTL_") for name in environment.WORKER_VARIABLES)


def test_secrets_are_not_in_its_repr():
    assert "pw" not in repr(FULL) and "s3cret" not in repr(FULL)


def test_the_default_key_prefix():
    assert WorkerEnvironment.from_env({}).key_prefix == DEFAULT_KEY_PREFIX


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("ELASTICCTL_RESTARTS", "-1", "The restarts spent '-1' in ELASTICCTL_RESTARTS must be a whole number"),
    ("ELASTICCTL_RESTARTS", "three", "The restarts spent 'three' in ELASTICCTL_RESTARTS"),
    ("ELASTICCTL_RESTARTS", "1e3", "The restarts spent '1e3'"),
    ("ELASTICCTL_RESTARTS", "٣", "The restarts spent '٣'"),  # an Arabic-Indic three: int() would take it
    ("ELASTICCTL_RESTARTS", "1234567890", "from 0 to 999999999"),
    ("ELASTICCTL_NODE", "a/b", "The node id in ELASTICCTL_NODE 'a/b' must be 1-63 letters"),
    ("ELASTICCTL_NODE", "n0\n", "The node id in ELASTICCTL_NODE 'n0\\\\n'"),
    ("ELASTICCTL_JOB", "../other", "The job name in ELASTICCTL_JOB '../other'"),
    ("ELASTICCTL_KEY_PREFIX", "jobs", "The key prefix in ELASTICCTL_KEY_PREFIX \\('jobs'\\) must be an absolute key path"),
    ("ELASTICCTL_KEY_PREFIX", "/team/jobs/", "ELASTICCTL_KEY_PREFIX \\('/team/jobs/'\\)"),
    ("ELASTICCTL_KEY_PREFIX", "/a/../b", "ELASTICCTL_KEY_PREFIX \\('/a/../b'\\)"),
    ("ELASTICCTL_NODE_ADDR", "10.0.0.1 10.0.0.2", "The node address '10.0.0.1 10.0.0.2' in ELASTICCTL_NODE_ADDR"),
    ("ELASTICCTL_WORKER_MARKS", "marks", "The worker marks directory 'marks' in ELASTICCTL_WORKER_MARKS must be an absolute"),
    ("ELASTICCTL_ETCD_CERT", "/c.pem", "ELASTICCTL_ETCD_CERT and ELASTICCTL_ETCD_KEY must be given together"),
    ("ELASTICCTL_HOT", "min_nodes=1", "The hot-recovery settings \\('min_nodes=1'\\) miss"),
    ("ELASTICCTL_HOT", "min_nodes=1,max_nodes=2,color=red", "setting 'color' in ELASTICCTL_HOT is unknown"),
    ("ELASTICCTL_HOT", "min_nodes=x,max_nodes=2", "min_nodes \\('x'\\) is not a number"),
    ("ELASTICCTL_HOT", "min_nodes=3,max_nodes=2", "node counts \\(3:2\\)"),
    ("ELASTICCTL_STRAGGLERS", "ratio=1", "The straggler setting ratio \\(1.0\\) must be a ratio above 1"),
    ("ELASTICCTL_STRAGGLERS", "ratio=x", "setting ratio \\('x'\\) in ELASTICCTL_STRAGGLERS is not a number"),
    ("ELASTICCTL_STRAGGLERS", "color=red", "setting 'color' in ELASTICCTL_STRAGGLERS is unknown"),
    ("ELASTICCTL_STRAGGLERS", "window=5,interval=10", "interval \\(10 steps\\) must not be above the window"),
    ("ELASTICCTL_STRAGGLERS", "evict=nan", "The straggler setting evict \\('nan'\\) in ELASTICCTL_STRAGGLERS is not a number"),
    ("ELASTICCTL_STRAGGLERS", "ratio=1_5", "The straggler setting ratio \\('1_5'\\) in ELASTICCTL_STRAGGLERS is not a number"),
    ("ELASTICCTL_HOT", "min_nodes=１,max_nodes=2", "min_nodes \\('１'\\) is not a number"),
])
def test_a_bad_value_is_one_sentence_naming_it(variable, value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        WorkerEnvironment.from_env({variable: value})
    text = str(caught.value)
    assert "\n" not in text and text.endswith(".") and text.count(". ") == 0


def test_bad_etcd_endpoints_are_refused_when_used():
    env = WorkerEnvironment.from_env({environment.ETCD: "http://e1:2379,https://e2:2379", environment.JOB: "demo"})
    with pytest.raises(ConfigError, match="mix http and https"):
        env.etcd_settings(retry_timeout=1.0)


def test_outside_elasticctl_there_is_no_job():
    env = WorkerEnvironment.from_env({})
    assert not env.in_job and env.etcd_settings(1.0) is None and env.job_keys() is None
    assert env.restarts is None and env.hot is None and env.secret_bytes() is None


def test_export_sets_its_variables_and_removes_the_rest_of_them():
    environ = {"PATH": "/bin", environment.HOT: "stale", environment.RESTARTS: "9", "ELASTICCTL_NNODES": "2"}
    environment.export(WorkerEnvironment(job="demo", restarts=1), environ)
    assert environ == {"PATH": "/bin", environment.JOB: "demo", environment.RESTARTS: "1", "ELASTICCTL_NNODES": "2"}


def test_readers_of_the_other_variables():
    assert environment.etcd_binary({}) is None
    assert environment.etcd_binary({environment.ETCD_BINARY: "/opt/etcd"}) == "/opt/etcd"
    assert environment.state_dir({environment.STATE_DIR: ""}) is None
    assert environment.etcd_password({environment.ETCD_PASSWORD: "pw"}) == "pw"


def test_this_process_decodes():
    WorkerEnvironment.from_env(os.environ)  # the test runner's own environment is a valid one


# Environment values: any text without NUL (the OS cannot carry one), sometimes near-valid.
_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=40)
_VALUES = {
    environment.RESTARTS: st.one_of(_TEXT, st.integers(-5, 10**10).map(str)),
    environment.KEY_PREFIX: st.one_of(_TEXT, st.from_regex(r"(/[a-z.]{1,4}){1,3}/?", fullmatch=True)),
    environment.HOT: st.one_of(_TEXT, st.lists(st.sampled_from([
        "min_nodes=1", "max_nodes=2", "max_nodes=0", "node_ttl=5", "node_ttl=1.5", "last_call=nan",
        "join_timeout=1e9", "run_ttl=7", "x=1", "last_call=0.25", ""]), max_size=6).map(",".join)),
    environment.STRAGGLERS: st.one_of(_TEXT, st.lists(st.sampled_from([
        "ratio=1.5", "ratio=1_5", "ratio=１.５", "ratio=2e0", "window=20", "window=２０", "interval=5",
        "evict=0", "evict=３", "evict=nan", "min_nodes=2", ""]), max_size=5).map(",".join)),
    environment.NODE: st.one_of(_TEXT, st.from_regex(r"[a-z0-9][a-z0-9._-]{0,70}", fullmatch=True)),
    environment.WORKER_MARKS: st.one_of(_TEXT, _TEXT.map(lambda text: "/" + text)),
}


@settings(max_examples=400, deadline=None)
@given(environ=st.dictionaries(
    st.sampled_from([*environment.WORKER_VARIABLES, "PATH", "ELASTICCTL_NNODES"]),
    st.none(), max_size=12).flatmap(lambda keys: st.fixed_dictionaries(
        {name: _VALUES.get(name, _TEXT) for name in keys})))
def test_anything_in_the_environment_decodes_or_is_one_config_error(environ):
    try:
        decoded = WorkerEnvironment.from_env(environ)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert WorkerEnvironment.from_env(decoded.to_env()) == decoded
