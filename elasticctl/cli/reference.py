"""The reference page of every option (docs/reference/options.md), written from the one table of
settings (:mod:`elasticctl.job.options`) and the click commands made from it.

    python -m elasticctl.cli.reference            print the page
    python -m elasticctl.cli.reference --write    rewrite docs/reference/options.md
    python -m elasticctl.cli.reference --check    exit 1 (naming the file) where it differs

tests/unit/test_options_table.py fails when the page in the repository differs from this.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from elasticctl.job import environment
from elasticctl.job.options import (
    OPTIONS,
    REFORM_LAST_CALL,
    TORCH_ONLY_OPTIONS,
    Home,
    Kind,
    Option,
    RecoveryMode,
    describe_default,
    number_text,
)
from elasticctl.job.settings import (
    HOT_SETTING_OPTIONS,
    REPLICA_SETTING_OPTIONS,
    STRAGGLER_SETTING_OPTIONS,
    WORKER_SETTINGS_VERSION,
    HotSettings,
    ReplicaCheckSettings,
    StragglerSettings,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "options.md"


def _range(option: Option) -> str:
    if option.kind in (Kind.WHOLE, Kind.STEPS):
        return f"{option.kind.value}, {option.low}–{number_text(option.high)}"
    if option.kind is Kind.SECONDS:
        return f"seconds, above 0, up to {number_text(option.high)}"
    if option.kind in (Kind.RATIO, Kind.RATIO_OR_ZERO):
        return f"{option.kind.value}, up to {number_text(option.high)}"
    if option.kind is Kind.RECOVERY:
        return " or ".join(mode.value for mode in RecoveryMode)
    return option.kind.value


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _code(text: str | None) -> str:
    return f"`{text}`" if text else "—"


def _settings_table() -> list[str]:
    lines = ["| `--rdzv-conf` key | flag of `up` | job.yaml key | environment | default | `up` sets | "
             "torch's default | range | home | meaning |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for option in OPTIONS:
        keys = ", ".join(f"`{key}`" for key in (option.name, *option.aliases))
        variables = [name for name in (option.flag_environment, option.environment) if name]
        lines.append("| " + " | ".join(_cell(cell) for cell in (
            keys, _code(option.flag), _code(option.job_file_key), ", ".join(f"`{v}`" for v in variables) or "—",
            describe_default(option),
            describe_default(option, option.up_default) if option.up_default is not None else "the default",
            describe_default(option, option.torch_default) if option.torch_default is not None else "—",
            _range(option), option.home.name.lower(),
            option.help + ("" if option.used else " Accepted, not used by elasticctl's etcd3 rendezvous."),
        )) + " |")
    return lines


def _homes() -> list[str]:
    lines = []
    for home in Home:
        names = ", ".join(f"`{option.name}`" for option in OPTIONS if option.home is home)
        lines.append(f"- **{home.name.lower()}** ({home.value}): {names}.")
    return lines


def _worker_settings() -> list[str]:
    def rows(section: str, settings: type, options: dict[str, str]) -> list[str]:
        return [f"| `{section}.{field.name}` | "
                + (f"`{options[field.name]}`" if field.name in options else
                   ("`--nnodes` MIN" if field.name == "min_nodes" else
                    "`--nnodes` MAX" if field.name == "max_nodes" else f"constant, {REFORM_LAST_CALL:g} s"))
                + " |" for field in dataclasses.fields(settings)]

    return [
        f"The rendezvous handler of each node hands its workers one JSON document in `{environment.WORKER_SETTINGS}`"
        f" (version {WORKER_SETTINGS_VERSION}), decided from the options above once per start of the workers and"
        " decoded and validated once by each worker; an unknown version, an unknown or missing field, or a"
        " value out of its option's range is one sentence naming it.",
        "",
        "| field | from |",
        "|---|---|",
        "| `version` | " + str(WORKER_SETTINGS_VERSION) + " |",
        "| `recovery` | `recovery` |",
        *rows("stragglers", StragglerSettings, STRAGGLER_SETTING_OPTIONS),
        "| `hot` | present in hot mode only |",
        *rows("hot", HotSettings, HOT_SETTING_OPTIONS),
        *rows("replicas", ReplicaCheckSettings, REPLICA_SETTING_OPTIONS),
    ]


def _flags(command: click.Command, name: str) -> list[str]:
    lines = [f"### `elasticctl {name}`", "", "| flag | default | help |", "|---|---|---|"]
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        flags = ", ".join(f"`{flag}`" for flag in param.opts)
        if param.is_flag:
            default = "off"
        elif param.show_default and param.default not in (None, ""):
            default = f"`{param.default}`"
        else:
            default = "—"
        lines.append(f"| {flags} | {default} | {_cell(' '.join((param.help or '').split()))} |")
    return lines


def render() -> str:
    from elasticctl.cli.lifecycle import join, up

    torch_only = ", ".join(f"`{name}`" for name in TORCH_ONLY_OPTIONS)
    lines = [
        "# Options reference",
        "",
        "<!-- Written by `python -m elasticctl.cli.reference --write` from the table in"
        " elasticctl/job/options.py; a unit test fails where this page and the code differ. -->",
        "",
        "Every setting of a job is declared once, in `elasticctl/job/options.py`. The `--rdzv-conf` parser, the"
        " flags of `elasticctl up` and `join`, the job spec's checks, the workers' settings and this page are"
        " made from that table.",
        "",
        "## Settings of a job",
        "",
        "A job file (`--config job.yaml`) takes a flag's name as its key (`-` or `_`), and the other options"
        " under `rdzv_conf:`. A flag's environment variable is `ELASTICCTL_<FLAG>`. \"`up` sets\" is the value"
        " `elasticctl up` gives where that differs from the default of the `etcd3` rendezvous under plain"
        " torchrun (and from torch's own, for torch's options).",
        "",
        *_settings_table(),
        "",
        f"Options of torch's launchers and other backends ({torch_only}) are accepted and ignored (a debug line),"
        " so code written for `c10d` or `etcd` runs unchanged.",
        "",
        "## One home per value",
        "",
        "Each setting lives in one place. One given both as its flag and as a `--rdzv-conf` key with different"
        " values (`--node-ttl 3 --rdzv-conf node_ttl=30`) is refused in one sentence naming both (exit 2); the"
        " same value twice is taken once. A node's own setting (how it reaches etcd) is refused in"
        " `--rdzv-conf`: each node gives its own flags.",
        "",
        *_homes(),
        "",
        "## The workers' settings",
        "",
        *_worker_settings(),
        "",
        "## Flags",
        "",
        *_flags(up, "up"),
        "",
        *_flags(join, "join"),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    page = render()
    if args == ["--write"]:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(page, encoding="utf-8")
        return 0
    if args == ["--check"]:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE} differs from the table; run python -m elasticctl.cli.reference --write.",
                  file=sys.stderr)
            return 1
        return 0
    if args:
        print("usage: python -m elasticctl.cli.reference [--write | --check]", file=sys.stderr)
        return 2
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
