"""The one table of settings (elasticctl/job/options.py) and everything made from it: the
``--rdzv-conf`` parser, the flags of `up` and `join`, the job spec's fields, the workers'
settings and the reference page agree with it, and each value has one home.

Layer tests/unit: no etcd, no processes (the CLI's entry point runs in this process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import click
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.helpers import MLP

from elasticctl.cli import main, reference
from elasticctl.cli.lifecycle import join, up
from elasticctl.cli.options import param_name, setting_help
from elasticctl.errors import ConfigError
from elasticctl.job import environment
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.options import (
    BY_KEY,
    BY_NAME,
    OPTIONS,
    REFORM_LAST_CALL,
    Home,
    Kind,
    RecoveryMode,
    settle,
    up_defaults,
)
from elasticctl.job.settings import (
    HOT_SETTING_OPTIONS,
    REPLICA_SETTING_OPTIONS,
    STRAGGLER_SETTING_OPTIONS,
    HotSettings,
    RdzvOptions,
    ReplicaCheckSettings,
    StragglerSettings,
    WorkerSettings,
    parse_rdzv_options,
)
from elasticctl.job.spec import JobSpec


def _cli(*argv: str, env: dict[str, str] | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """The CLI's entry point in this process: (exit code, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, stdout.getvalue(), stderr.getvalue()


def _up(*flags: str, **kwargs) -> tuple[int, str, str]:
    return _cli("up", "--dry-run", "--etcd", "127.0.0.1:2379", "--nnodes", "1:3", *flags, MLP, **kwargs)


def _rdzv_conf(command_line: str) -> list[tuple[str, str]]:
    """The rendezvous options of a printed torchrun command, in order, repeats kept."""
    text = command_line.split("--rdzv-conf=")[1].split()[0]
    return [tuple(item.split("=", 1)) for item in text.split(",")]


# -- the parser and RdzvOptions are the table's -------------------------------------------------

def test_rdzv_options_has_one_field_per_row_with_its_default():
    fields = dataclasses.fields(RdzvOptions)
    assert [field.name for field in fields] == [option.name for option in OPTIONS]
    assert {field.name: field.default for field in fields} == {option.name: option.default for option in OPTIONS}
    assert parse_rdzv_options({}) == RdzvOptions()
    hidden = {option.name for option in OPTIONS if option.secret}
    assert hidden == {"password", "secret"} and {field.name for field in fields if not field.repr} == hidden


def test_every_key_and_alias_of_the_table_is_parsed_and_nothing_else():
    assert set(BY_KEY) == {key for option in OPTIONS for key in (option.name, *option.aliases)}
    with pytest.raises(ConfigError, match="The rendezvous option 'node_tll' is unknown"):
        parse_rdzv_options({"node_tll": "5"})


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind not in (Kind.TEXT, Kind.PROTOCOL)],
                         ids=lambda o: o.name)
def test_each_default_reads_back_and_each_bound_is_the_tables(option):
    if option.default is not None:
        text = option.default.value if isinstance(option.default, RecoveryMode) else str(option.default)
        assert getattr(parse_rdzv_options({option.name: text}), option.name) == option.default
    if option.kind in (Kind.WHOLE, Kind.STEPS):  # (the window's rule across two options aside)
        assert option.parse(option.name, str(option.low)) == option.low
        assert option.parse(option.name, str(option.high)) == option.high
        for outside in (option.low - 1, option.high + 1):
            with pytest.raises(ConfigError, match=rf"must be a whole number.* from {option.low} to {option.high}\."):
                parse_rdzv_options({option.name: str(outside)})


def test_options_torch_has_carry_torchs_defaults_and_up_says_where_it_differs():
    assert {o.name: o.torch_default for o in OPTIONS if o.torch_default is not None} == {
        "join_timeout": 600, "last_call_timeout": 30, "close_timeout": 30, "heartbeat_timeout": 5,
        "keep_alive_interval": 5, "keep_alive_max_attempt": 3}
    # The only rendezvous option `up` sets differently; keep-alive is no longer overridden (the
    # etcd3 rendezvous does not use it: liveness is node_ttl).
    assert up_defaults() == {"last_call_timeout": "1"}
    assert not BY_NAME["keep_alive_interval"].used and not BY_NAME["keep_alive_max_attempt"].used


# -- the flags of `up` and `join` are made from the table ----------------------------------------

# The options of `up` and `join` that are no setting of a job: what to run, where, how to start
# this node and its embedded etcd, where this node's workers' output goes (torchrun's own), and
# which admission checks this node runs (--skip-check, --check: each node's own). --code-hash names
# the code whose digests `up` records beside the script's: spec fields like the script, which the
# rendezvous handler never reads.
ADMISSION = {"skip_checks", "checks"}
WORKER_LOGS = {"log_dir", "tee", "redirects", "local_ranks_filter"}
COMMAND_OPTIONS = {
    "up": {"etcd_endpoints", "job", "nnodes", "nproc_per_node", "checkpoint_dir", "env", "rdzv_conf",
           "legacy_local_rank", "node_id", "local_addr", "etcd_listen", "etcd_port", "etcd_peer_port",
           "etcd_data_dir", "module", "dry_run", "script", "script_args", "config", "help", *WORKER_LOGS,
           "code_hash", *ADMISSION},
    "join": {"etcd_endpoints", "job", "wait_seconds", "node_id", "local_addr", "dry_run", "help", *WORKER_LOGS,
             *ADMISSION},
}


@pytest.mark.parametrize(("command", "homes"), [(up, set(Home)), (join, {Home.NODE})], ids=["up", "join"])
def test_every_flag_of_a_setting_is_the_tables(command, homes):
    params = {param.name: param for param in command.params}
    flagged = [option for option in OPTIONS if option.flag and option.home in homes]
    for option in flagged:
        param = params[param_name(option)]
        assert param.opts == [option.flag], option.name
        assert param.help == setting_help(option), option.name
        expected = {Home.SPEC: option.up_default if option.up_default is not None else option.default,
                    Home.NODE: option.default, Home.RDZV_CONF: None}[option.home]
        assert param.default == expected, option.name
    # Nothing else of the command sets a setting of the job: a new one goes into the table.
    others = set(params) - {param_name(option) for option in flagged} - {None}
    assert others <= COMMAND_OPTIONS[command.name], others - COMMAND_OPTIONS[command.name]


def test_up_help_shows_its_defaults_that_differ_from_torchs():
    code, stdout, _ = _cli("up", "--help")
    text = " ".join(stdout.split())
    assert code == 0
    assert "`up` sets last_call_timeout=1 (torch: 30) unless given" in text
    assert "(`up`'s default; plain torchrun's: none) [default: 3]" in text
    assert "x<=None" not in text


# -- one home per value ---------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "conf", "spec", "options", "error"), [
    # a setting of the spec, given once either way, or twice alike
    ({"node_ttl": "3"}, {}, {"node_ttl": "3"}, {}, None),
    ({}, {"node_ttl": "30"}, {"node_ttl": "30"}, {}, None),
    ({"node_ttl": "3"}, {"node_ttl": "3"}, {"node_ttl": "3"}, {}, None),
    ({"node_ttl": "3"}, {"node_ttl": "30"}, None, None, "--node-ttl 3 and --rdzv-conf node_ttl=30 disagree"),
    ({"max_restarts": "5"}, {"max_restarts": "2"}, None, None, "--max-restarts 5 and --rdzv-conf max_restarts=2"),
    # a rendezvous option with a flag
    ({"straggler_ratio": "2"}, {"straggler_ratio": "2.0"}, {}, {"straggler_ratio": "2"}, None),
    ({"straggler_ratio": "2"}, {"straggler_ratio": "3"}, None, None,
     "--straggler-ratio 2 and --rdzv-conf straggler_ratio=3 disagree"),
    ({"recovery": "hot"}, {"recovery": "HOT"}, {}, {"recovery": "hot"}, None),
    ({"recovery": "hot"}, {"recovery": "restart"}, None, None, "--recovery hot and --rdzv-conf recovery=restart"),
    ({"spares": "1"}, {"spares": " "}, None, None, "The rendezvous option 'spares' is empty"),
    ({"spares": "1"}, {"spares": "x"}, None, None, "spares (--spares) ('x') must be a whole number"),
    # one without a flag, and one the table does not know (the spec's check names it)
    ({}, {"read_timeout": "3"}, {}, {"read_timeout": "3"}, None),
    ({}, {"node_tll": "3"}, {}, {"node_tll": "3"}, None),
    # a node's own settings are never the job's
    ({}, {"cacert": "/ca.pem"}, None, None, "cacert=/ca.pem is each node's own, not the job's: give it with "
                                            "--etcd-cacert"),
    ({}, {"ca_cert": "/ca.pem"}, None, None, "give it with --etcd-cacert"),
    ({}, {"key_prefix": "/x"}, None, None, "give it with --key-prefix"),
    ({}, {"password": "hunter2"}, None, None, "password is each node's own, not the job's: give it in "
                                              "ELASTICCTL_ETCD_PASSWORD"),
    ({}, {"run": "7"}, None, None, "`up` and `join` set it"),
])
def test_settle(flags, conf, spec, options, error):
    if error is None:
        assert settle(flags, conf) == (spec, options)
    else:
        with pytest.raises(ConfigError) as caught:
            settle(flags, conf)
        assert error in str(caught.value) and "hunter2" not in str(caught.value)


@settings(max_examples=300, deadline=None)
@given(flags=st.dictionaries(st.sampled_from([o.name for o in OPTIONS if o.flag and o.home is not Home.NODE]),
                             st.sampled_from(["0", "1", "2", "3", "2.5", "hot", "restart", "x"]), max_size=4),
       conf=st.dictionaries(st.sampled_from([*BY_KEY, "node_tll"]),
                            st.sampled_from(["0", "1", "2", "3", "2.5", "hot", "/x", "", "x"]), max_size=4))
def test_any_flags_and_options_settle_into_one_home_or_one_sentence(flags, conf):
    try:
        spec, options = settle(flags, conf)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert all(BY_NAME[name].home is Home.SPEC for name in spec)
    known = [BY_KEY[key] for key in options if key in BY_KEY]
    assert all(option.home is Home.RDZV_CONF for option in known)
    assert len({option.name for option in known}) == len(known)  # no alias beside its option
    for name, text in flags.items():  # a flag's value is kept, in its setting's home
        assert (spec if BY_NAME[name].home is Home.SPEC else options)[name] == text


def test_the_spec_keeps_a_value_in_one_home():
    twice = JobSpec("j", "train.py", node_ttl=3, rdzv_conf=(("node_ttl", "3"), ("spares", "1")))
    assert twice.rdzv_conf == (("spares", "1"),) and twice.node_ttl == 3
    assert twice.options.node_ttl == 3 and twice.options.max_restarts == 3 and twice.options.spares == 1
    with pytest.raises(ConfigError, match=r"^The job's node_ttl \(5\) and its rendezvous option node_ttl=30 "
                                          r"disagree; give the setting once\.$"):
        JobSpec("j", "train.py", rdzv_conf=(("node_ttl", "30"),))
    with pytest.raises(ConfigError, match="is each node's own"):
        JobSpec("j", "train.py", rdzv_conf=(("key_prefix", "/x"),))


@pytest.mark.parametrize("name", [option.name for option in OPTIONS if option.home is Home.SPEC])
def test_the_specs_fields_are_the_tables(name):
    option = BY_NAME[name]
    field = {field.name: field for field in dataclasses.fields(JobSpec)}[name]
    assert field.default == (option.up_default if option.up_default is not None else option.default)
    JobSpec("j", "train.py", **{name: option.low})
    JobSpec("j", "train.py", **{name: int(option.high)})
    for outside in (option.low - 1, int(option.high) + 1):
        with pytest.raises(ConfigError, match=rf"\({outside}"):
            JobSpec("j", "train.py", **{name: outside})


def test_up_refuses_a_setting_given_twice_with_two_values_naming_both(monkeypatch):
    code, _, stderr = _up("--node-ttl", "3", "--rdzv-conf", "node_ttl=30", monkeypatch=monkeypatch)
    assert code == 2 and stderr.strip().splitlines() == [
        "elasticctl: error: --node-ttl 3 and --rdzv-conf node_ttl=30 disagree; give the setting once."]


@pytest.mark.parametrize("source", ["environment", "job file"])
def test_a_flag_from_the_environment_or_a_job_file_is_given_too(tmp_path, monkeypatch, source):
    if source == "environment":
        code, _, stderr = _up("--rdzv-conf", "spares=2", env={"ELASTICCTL_SPARES": "1"}, monkeypatch=monkeypatch)
    else:
        config = tmp_path / "job.yaml"
        config.write_text(yaml.safe_dump({"spares": 1}))
        code, _, stderr = _up("--config", str(config), "--rdzv-conf", "spares=2", monkeypatch=monkeypatch)
    assert code == 2 and "--spares 1 and --rdzv-conf spares=2 disagree" in stderr, stderr


def test_the_torchrun_command_carries_each_setting_once(monkeypatch):
    code, stdout, stderr = _up("--rdzv-conf", "node_ttl=30,max_restarts=7,last_call_timeout=4",
                               monkeypatch=monkeypatch)
    assert code == 0, stderr
    conf = _rdzv_conf(stdout)
    keys = [key for key, _ in conf]
    assert len(keys) == len(set(keys)), conf
    assert dict(conf)["node_ttl"] == "30" and dict(conf)["max_restarts"] == "7"
    assert dict(conf)["last_call_timeout"] == "4" and "keep_alive_interval" not in dict(conf)
    code, stdout, _ = _up(monkeypatch=monkeypatch)
    assert dict(_rdzv_conf(stdout))["last_call_timeout"] == "1"


def test_the_rendezvous_secret_has_one_home(monkeypatch):
    code, _, stderr = _up("--rdzv-conf", "secret=a", env={environment.RDZV_SECRET: "b"}, monkeypatch=monkeypatch)
    assert code == 2 and "secret and ELASTICCTL_RDZV_SECRET differ" in stderr and "'a'" not in stderr


# -- the recovery mode travels as one enum, the worker settings as one document ---------------------

@pytest.mark.parametrize("mode", list(RecoveryMode))
def test_the_recovery_mode_travels_from_the_flag_to_the_worker(monkeypatch, mode):
    code, stdout, stderr = _up("--recovery", mode.value, monkeypatch=monkeypatch)
    assert code == 0, stderr
    options = parse_rdzv_options(dict(_rdzv_conf(stdout)))  # what the node's handler reads
    assert options.recovery is mode
    settings_ = WorkerSettings.of(options, min_nodes=1, max_nodes=3)  # what it hands the workers
    worker = WorkerEnvironment.from_env(WorkerEnvironment(settings=settings_).to_env())
    assert worker.recovery is mode and (worker.settings.hot is not None) == (mode is RecoveryMode.HOT)


@pytest.mark.parametrize(("field", "name"), [
    *(("hot." + field, name) for field, name in HOT_SETTING_OPTIONS.items()),
    *(("stragglers." + field, name) for field, name in STRAGGLER_SETTING_OPTIONS.items()),
    *(("replicas." + field, name) for field, name in REPLICA_SETTING_OPTIONS.items()),
])
def test_each_worker_setting_is_its_options_value(field, name):
    option = BY_NAME[name]
    value = {Kind.RATIO: 3.5, Kind.RATIO_OR_ZERO: 4.5}.get(option.kind, min(40, option.high))
    conf = {"recovery": "hot", name: str(value)}
    if name == "straggler_interval":
        conf["straggler_window"] = "60"
    settings_ = WorkerSettings.of(parse_rdzv_options(conf), min_nodes=2, max_nodes=3)
    section, _, attribute = field.partition(".")
    assert getattr(getattr(settings_, section), attribute) == value


def test_the_worker_settings_defaults_are_the_tables():
    assert StragglerSettings() == StragglerSettings.of(parse_rdzv_options({}), min_nodes=1)
    assert ReplicaCheckSettings() == ReplicaCheckSettings.of(parse_rdzv_options({}), min_nodes=1)
    hot = HotSettings(min_nodes=1, max_nodes=2)
    # A job `up` starts: its last call, and the table's defaults for the rest.
    assert hot == WorkerSettings.of(parse_rdzv_options({"recovery": "hot", **up_defaults()}), 1, 2).hot
    assert hot.reform_last_call == REFORM_LAST_CALL


def test_the_worker_settings_document_is_versioned_json():
    settings_ = WorkerSettings.of(parse_rdzv_options({"recovery": "hot"}), 1, 2)
    data = json.loads(settings_.to_json())
    assert data["version"] == 3 and data["recovery"] == "hot" and set(data) == {"version", "recovery", "stragglers",
                                                                                "hot", "replicas", "non_finite"}
    assert WorkerSettings.from_json(settings_.to_json()) == settings_
    restart = WorkerSettings.of(parse_rdzv_options({}), 1, 2)
    assert restart.hot is None and json.loads(restart.to_json())["hot"] is None
    assert list(WorkerEnvironment(settings=restart).to_env()) == [environment.WORKER_SETTINGS]


# -- the reference page ---------------------------------------------------------------------------

def test_the_reference_page_is_the_tables():
    assert reference.PAGE.read_text(encoding="utf-8") == reference.render(), (
        "docs/reference/options.md differs from the table: run python -m elasticctl.cli.reference --write")


def test_the_reference_page_names_every_option_flag_and_variable():
    page = reference.render()
    for option in OPTIONS:
        assert f"`{option.name}`" in page
        for name in (option.flag, option.environment, option.flag_environment):
            assert name is None or f"`{name}`" in page, name
    for command in (up, join):
        for param in command.params:
            if isinstance(param, click.Option):
                assert f"`{param.opts[0]}`" in page, param.opts


def test_the_tables_variables_are_the_environments():
    # job/environment.py names every ELASTICCTL_* variable; the table's are the same names.
    assert BY_NAME["password"].environment == environment.ETCD_PASSWORD
    assert BY_NAME["secret"].environment == environment.RDZV_SECRET
    assert BY_NAME["cacert"].flag_environment == environment.ETCD_CACERT
    assert BY_NAME["user"].flag_environment == environment.ETCD_USER


def test_the_defaults_below_the_table_are_the_tables():
    # The etcd client sits below job/ (it cannot import the table): its defaults are checked here.
    import inspect

    from elasticctl.etcd.client import EtcdSettings, connect
    from elasticctl.rendezvous.policy import BudgetRules

    fields = {field.name: field.default for field in dataclasses.fields(EtcdSettings)}
    assert fields["read_timeout"] == BY_NAME["read_timeout"].default
    assert fields["retry_timeout"] == BY_NAME["retry_timeout"].default
    assert fields["connect_timeout"] == BY_NAME["connect_timeout"].default
    assert inspect.signature(connect).parameters["timeout"].default is None  # the settings' connect_timeout
    assert BudgetRules().quarantine_window == BY_NAME["quarantine_window"].default
