"""The worker environment's codec: what the node and its handler write, every worker reads back;
every bad value is one ConfigError sentence naming it; anything else in an environment is untrusted."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticctl.errors import ConfigError
from elasticctl.job import environment
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.keys import DEFAULT_KEY_PREFIX
from elasticctl.job.options import RecoveryMode
from elasticctl.job.settings import HotSettings, ReplicaCheckSettings, StragglerSettings, WorkerSettings

FULL = WorkerEnvironment(
    node="n0", node_addr="10.0.0.7", restarts=3, marks_dir="/tmp/marks/round-2", job="demo",
    key_prefix="/team/jobs", etcd="https://e1:2379,https://e2:2379", etcd_cacert="/ca.pem",
    etcd_cert="/c.pem", etcd_key="/k.pem", etcd_user="trainer", etcd_password="pw",
    checkpoint_dir="/ckpt", rdzv_secret="s3cret", settings=WorkerSettings(
        RecoveryMode.HOT, StragglerSettings(ratio=2.0, window=30, interval=5, evict=3.0, min_nodes=2),
        HotSettings(min_nodes=1, max_nodes=4, node_ttl=7), ReplicaCheckSettings(interval=7, evict=1, min_nodes=2)))

# A valid worker settings document, for the sentences about one changed part of it.
DOCUMENT = json.loads(FULL.settings.to_json())


def document(**changes) -> str:
    """DOCUMENT with ``changes`` (``hot__node_ttl=0``: a field of a section; None removes it)."""
    data = json.loads(json.dumps(DOCUMENT))
    for name, value in changes.items():
        section, _, field = name.rpartition("__")
        target = data[section] if section else data
        if value is None:
            target.pop(field, None)
        else:
            target[field] = value
    return json.dumps(data)


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


SETTINGS = environment.WORKER_SETTINGS


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
    (SETTINGS, document(hot__max_nodes=None),
     "The hot-recovery settings in ELASTICCTL_WORKER_SETTINGS miss max_nodes"),
    (SETTINGS, document(hot__color="red"), "setting 'color' in ELASTICCTL_WORKER_SETTINGS is unknown"),
    (SETTINGS, document(hot__min_nodes="x", hot__max_nodes=2), "node counts \\('x':2\\)"),
    (SETTINGS, document(hot__min_nodes=3, hot__max_nodes=2), "node counts \\(3:2\\)"),
    (SETTINGS, document(hot__node_ttl=1), "The hot-recovery setting node_ttl \\(1\\) must be a whole number from 2"),
    (SETTINGS, document(hot__node_ttl=5.5), "node_ttl \\(5.5\\) must be a whole number"),
    (SETTINGS, document(hot__last_call=-1), "last_call \\(-1\\) must be a positive number of seconds"),
    (SETTINGS, document(hot__join_timeout=True), "join_timeout \\(True\\) must be a positive number"),
    (SETTINGS, document(stragglers__ratio=1.0), "The straggler setting ratio \\(1.0\\) must be a ratio above 1"),
    (SETTINGS, document(stragglers__ratio="x"), "The straggler setting ratio \\('x'\\) must be a ratio above 1"),
    (SETTINGS, document(stragglers__color="red"), "straggler setting 'color' in ELASTICCTL_WORKER_SETTINGS is unknown"),
    (SETTINGS, document(stragglers__window=5, stragglers__interval=10),
     "interval \\(10 steps\\) must not be above the window"),
    (SETTINGS, document().replace('"evict": 3.0', '"evict": NaN'),
     "The worker settings in ELASTICCTL_WORKER_SETTINGS .* are not a JSON object"),
    (SETTINGS, document(stragglers__ratio="1_5"), "The straggler setting ratio \\('1_5'\\) must be a ratio"),
    (SETTINGS, document(hot__min_nodes="１"), "node counts \\('１':4\\)"),
    (SETTINGS, document(replicas__evict=2), "The replica-check setting evict \\(2\\) must be a whole number from 0 to 1"),
    (SETTINGS, document(replicas__evict=True), "The replica-check setting evict \\(True\\) must be a whole number"),
    (SETTINGS, document(replicas__interval=-1), "The replica-check setting interval \\(-1\\) must be a whole number of "
     "steps from 0 to 1000000"),
    (SETTINGS, document(replicas=None), "The worker settings in ELASTICCTL_WORKER_SETTINGS miss replicas"),
    (SETTINGS, document(version=1), "have the version '1'; this elasticctl reads version 3"),
    (SETTINGS, document(version="2"), "have the version '2'; this elasticctl reads version 3"),
    (SETTINGS, document(version=None), "have the version 'None'"),
    (SETTINGS, document(recovery="warm"), "The recovery mode 'warm' in ELASTICCTL_WORKER_SETTINGS must be one of: "
     "restart, hot"),
    (SETTINGS, document(recovery=None), "The worker settings in ELASTICCTL_WORKER_SETTINGS miss recovery"),
    (SETTINGS, document(recovery="restart"), "The worker settings of restart mode take no hot-recovery settings"),
    (SETTINGS, json.dumps({**DOCUMENT, "hot": None}), "The worker settings of hot mode need hot-recovery settings"),
    (SETTINGS, document(mode="hot"), "The worker setting 'mode' in ELASTICCTL_WORKER_SETTINGS is unknown"),
    (SETTINGS, "recovery=hot", "The worker settings in ELASTICCTL_WORKER_SETTINGS \\('recovery=hot'\\) are not a JSON"),
    (SETTINGS, "[1]", "are not a JSON object"),
    (SETTINGS, json.dumps({**DOCUMENT, "stragglers": [1]}), "The straggler settings in ELASTICCTL_WORKER_SETTINGS "
     "are not a JSON object"),
    (SETTINGS, " " * 5000, "longer than 4096 characters"),
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
    assert env.restarts is None and env.settings is None and env.secret_bytes() is None
    assert env.recovery is RecoveryMode.RESTART


def test_export_sets_its_variables_and_removes_the_rest_of_them():
    environ = {"PATH": "/bin", environment.WORKER_SETTINGS: "stale", environment.RESTARTS: "9", "ELASTICCTL_NNODES": "2"}
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
_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**7), st.floats(allow_nan=False),
                        st.sampled_from(["hot", "restart", "1", "１", "1_5", ""]), st.just([1]))


def _near(section: dict) -> st.SearchStrategy:
    """``section`` with each field kept, changed to one of _JSON_VALUES, or removed, and maybe one unknown."""
    return st.fixed_dictionaries({}, optional={
        **{name: st.one_of(st.just(value), _JSON_VALUES) for name, value in section.items()},
        "color": _JSON_VALUES})


_DOCUMENTS = st.fixed_dictionaries({
    "version": st.one_of(st.just(2), _JSON_VALUES),
    "recovery": st.one_of(st.sampled_from(["hot", "restart"]), _JSON_VALUES),
    "stragglers": st.one_of(st.none(), _near(DOCUMENT["stragglers"]), _JSON_VALUES),
    "hot": st.one_of(st.none(), _near(DOCUMENT["hot"]), _JSON_VALUES),
    "replicas": st.one_of(st.none(), _near(DOCUMENT["replicas"]), _JSON_VALUES),
}).flatmap(lambda document: _near(document))
_VALUES = {
    environment.RESTARTS: st.one_of(_TEXT, st.integers(-5, 10**10).map(str)),
    environment.KEY_PREFIX: st.one_of(_TEXT, st.from_regex(r"(/[a-z.]{1,4}){1,3}/?", fullmatch=True)),
    # The worker settings document: JSON near the valid one (any field of it anything from a few
    # kinds of values, some removed, some unknown), or any text.
    environment.WORKER_SETTINGS: st.one_of(_TEXT, _DOCUMENTS.map(json.dumps)),
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
