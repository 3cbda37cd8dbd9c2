"""The ``elasticctl`` command line: parse, call the library, map errors to exit codes.

Never imports torch: commands answer instantly, and torch loads only in torchrun.
Every option can also come from an ``ELASTICCTL_<OPTION>`` environment variable.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click

from elasticctl import __version__
from elasticctl.errors import ElasticctlError

log = logging.getLogger("elasticctl")


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"elasticctl: error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"auto_envvar_prefix": "ELASTICCTL", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="elasticctl")
@click.option("-v", "--verbose", is_flag=True, help="Log what elasticctl does.")
def cli(verbose: bool) -> None:
    """Elastic multi-node PyTorch training on etcd v3: one command per host."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s elasticctl %(levelname)s %(message)s",
    )


@cli.command()
@click.option("--data-dir", default=None, help="Where etcd keeps its data (default: a temporary directory).")
@click.option("--listen", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--advertise", default=None, help="Address other hosts use to reach this etcd.")
@click.option("--client-port", type=int, default=2379, show_default=True)
@click.option("--peer-port", type=int, default=2380, show_default=True)
@click.option("--name", default="elasticctl", show_default=True, help="The etcd member name.")
def etcd(data_dir, listen, advertise, client_port, peer_port, name) -> None:
    """Run a standalone single-member etcd (v3 API only) until interrupted."""
    from elasticctl.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(
        data_dir=data_dir, listen_host=listen, advertise_host=advertise,
        client_port=client_port, peer_port=peer_port, name=name,
    )
    server.start()
    click.echo(f"etcd is serving at {server.endpoint} (pid {server.pid}); Ctrl-C stops it.", err=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            if server.exit_code() is not None:
                _fail(f"etcd exited unexpectedly with code {server.exit_code()}.")
    finally:
        server.stop()


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--etcd", "etcd_endpoints", default=None,
              help="etcd endpoints HOST:PORT[,...]; without it, start an embedded etcd on this host.")
@click.option("--job", default="elastic-job", show_default=True, help="The job name (torchrun's --rdzv-id).")
@click.option("--nnodes", required=True, help="Node count: N, or MIN:MAX for an elastic job.")
@click.option("--nproc-per-node", default="1", show_default=True, help="Workers per node, or 'auto' (one per GPU).")
@click.option("--max-restarts", type=int, default=3, show_default=True, help="Worker-group failures tolerated.")
@click.option("--rdzv-conf", default="", help="Extra rendezvous options k=v,... (timeouts, TLS, secret).")
@click.option("--local-addr", default=None, help="This node's address as other nodes see it.")
@click.option("--etcd-listen", default="0.0.0.0", show_default=True, help="Embedded etcd: address to listen on.")
@click.option("--etcd-port", type=int, default=2379, show_default=True, help="Embedded etcd: client port.")
@click.option("--etcd-peer-port", type=int, default=2380, show_default=True, help="Embedded etcd: peer port.")
@click.option("--etcd-data-dir", default=None, help="Embedded etcd: data directory (default: temporary).")
@click.option("-m", "--module", is_flag=True, help="SCRIPT is a Python module name, as with python -m.")
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and exit.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def up(etcd_endpoints, job, nnodes, nproc_per_node, max_restarts, rdzv_conf, local_addr, etcd_listen,
       etcd_port, etcd_peer_port, etcd_data_dir, module, dry_run, script, script_args) -> None:
    """Start a job: launch this node's torchrun with the etcd3 rendezvous.

    Without --etcd, an embedded etcd starts on this host and the line for
    other hosts is printed.
    """
    from elasticctl import launcher
    from elasticctl.etcd import EtcdSettings
    from elasticctl.etcd_server import EmbeddedEtcd
    from elasticctl.spec import JobSpec, parse_nnodes, parse_rdzv_conf

    low, high = parse_nnodes(nnodes)
    spec = JobSpec(
        name=job, script=script, script_args=tuple(script_args), min_nodes=low, max_nodes=high,
        nproc_per_node=nproc_per_node, max_restarts=max_restarts,
        rdzv_conf=tuple(parse_rdzv_conf(rdzv_conf).items()), module=module,
    )
    launcher.check_script(spec)

    server = None
    if etcd_endpoints is None:
        server = EmbeddedEtcd(
            data_dir=etcd_data_dir, listen_host=etcd_listen, client_port=etcd_port, peer_port=etcd_peer_port,
            advertise_host=None if launcher.is_loopback(etcd_listen) else launcher.primary_address(),
        )
        endpoint, etcd_host = server.endpoint, server.client_host
    else:
        settings = EtcdSettings.from_string(etcd_endpoints)
        endpoint, etcd_host = settings.describe(), settings.endpoints[0].host
    command = launcher.torchrun_command(spec, endpoint, local_addr or launcher.local_address_for(etcd_host))
    if dry_run:
        click.echo(launcher.format_command(command))
        return

    if server is not None:
        server.start()
        click.echo(f"Embedded etcd serving at {server.endpoint}. On every other host run:", err=True)
        click.echo(
            f"  elasticctl up --etcd {server.endpoint} --job {job} --nnodes {nnodes} "
            f"--nproc-per-node {nproc_per_node} {launcher.format_command([script, *script_args])}",
            err=True,
        )
    try:
        click.echo(f"+ {launcher.format_command(command)}", err=True)
        code = launcher.run_supervised(command, dict(os.environ))
    finally:
        if server is not None:
            server.stop()
    sys.exit(code)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted.", 130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ElasticctlError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted.", 130)


if __name__ == "__main__":
    main()
