"""Jobs of real `elasticctl up`/`join` processes on a test's etcd, read through their records and keys."""

from __future__ import annotations

import json

from support.helpers import ELASTICCTL, MLP, WORKERS, cli, read_records, trained_together, wait_for

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.registry import Registry

ALLREDUCE = str(WORKERS / "allreduce.py")
TRAIN = [MLP, "--steps", "100000", "--step-sleep", "0.05", "--log-every", "0"]


def steps_at(records: list[dict], world: int, nodes: set[str] | None = None) -> list[dict]:
    return [r for r in records if "event" not in r and r.get("world_size") == world
            and (nodes is None or r.get("node") in nodes)]


def after(records: list[dict], t: float) -> list[dict]:
    return [r for r in records if r.get("time", 0) > t]


class Job:
    """A job on the test's etcd: start nodes with `up`/`join`, read its records and keys."""

    def __init__(self, nodes, etcd, run_id, tmp_path, nnodes="1:3", extra=(), train=TRAIN):
        self.nodes, self.etcd, self.name = nodes, etcd, run_id
        self.record = tmp_path / "record.jsonl"
        self.up_args = ["--etcd", etcd.endpoint, "--job", run_id, "--nnodes", nnodes, *extra,
                        *train, "--record", str(self.record)]
        self.client = EtcdClient(etcd.client_settings())
        self.registry = Registry(self.client, run_id)

    def up(self, node_id: str, env: dict | None = None):
        return self.nodes(node_id, [*ELASTICCTL, "up", "--node-id", node_id, *self.up_args], env)

    def join(self, node_id: str, env: dict | None = None):
        """``env``: the node's own variables (e.g. CUDA_VISIBLE_DEVICES: one host playing several)."""
        return self.nodes(node_id, [*ELASTICCTL, "join", "--etcd", self.etcd.endpoint, "--job", self.name,
                                    "--node-id", node_id], env)

    def records(self) -> list[dict]:
        return read_records(self.record)

    def start(self, *names: str, timeout: float = 180) -> dict:
        """`up` on the first node, `join` on the others; wait until all of them train together."""
        started = {names[0]: self.up(names[0])}
        wait_for(self.registry.read_spec, 60, "the job spec in etcd")
        started.update({name: self.join(name) for name in names[1:]})
        self.wait_world(len(names), set(names), timeout=timeout)
        return started

    def wait_world(self, world: int, nodes: set[str], timeout: float = 180, since: float = 0.0) -> list[dict]:
        """Wait until every node in ``nodes`` trained a step at ``world`` workers after ``since``."""
        return wait_for(lambda: trained_together(self.records(), world, nodes, since=since), timeout,
                        f"nodes {sorted(nodes)} training at world size {world}")

    def status(self) -> dict:
        result = cli("status", "--etcd", self.etcd.endpoint, "--job", self.name, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)
