"""The ``elasticctl`` command line: parse, call the library, map errors to exit codes.

Never imports torch: commands answer instantly, and torch loads only in torchrun.
Every option can also come from an ``ELASTICCTL_<OPTION>`` environment variable.

This package holds the group and :func:`main`; the commands are in ``lifecycle.py``
(``etcd``, ``up``, ``join``, ``leave``, ``down``) and ``inspection.py`` (``doctor``,
``status``, ``events``, ``dashboard``, ``jobs``), on the options of ``options.py``
and the job files of ``job_file.py``.
"""

from __future__ import annotations

import logging

import click

from elasticctl import __version__
from elasticctl.cli.inspection import dashboard, doctor, events, jobs, status
from elasticctl.cli.lifecycle import down, etcd, join, leave, up
from elasticctl.cli.options import _fail
from elasticctl.errors import ElasticctlError


@click.group(context_settings={"auto_envvar_prefix": "ELASTICCTL", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="elasticctl")
@click.option("-v", "--verbose", is_flag=True, help="Log what elasticctl does.")
def cli(verbose: bool) -> None:
    """Elastic multi-node PyTorch training on etcd v3: one command per host."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s elasticctl %(levelname)s %(message)s",
    )


for _command in (etcd, up, join, doctor, status, events, dashboard, jobs, leave, down):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """The ``elasticctl`` entry point (``argv``: the arguments, default sys.argv[1:])."""
    try:
        cli.main(args=argv, prog_name="elasticctl", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted.", 130)
    except click.ClickException as exc:
        # One line, like every other error; `--help` has the usage.
        _fail(exc.format_message().replace("\n", " "), exc.exit_code)
    except ElasticctlError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted.", 130)
