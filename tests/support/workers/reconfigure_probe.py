"""One worker of tests/process/test_torch_reconfigure.py: torch's in-place reconfiguration, driven
through elasticctl.train.groups.reconfigure as the runtime drives it.

    reconfigure_probe.py COORD_PORT NAME SCENARIO

The workers meet on the test's TCPStore at COORD_PORT (the out-of-band exchange the
generations do in etcd); each generation's own store is a TCPStore hosted by one of them, as a
generation's rank 0 hosts it. Every result goes to the coordination store under
``result/<NAME>/<what>`` as JSON, for the test to assert on.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticctl.train.groups.connections import GenerationConnections
from elasticctl.train.groups.reconfigure import ReconfigurableGroup

TIMEOUT = datetime.timedelta(seconds=30)


def main() -> None:
    port, name, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    coord = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    def result(what: str, value) -> None:
        coord.set(f"result/{name}/{what}", json.dumps(value))

    group = ReconfigurableGroup("gloo", datetime.timedelta(seconds=float(os.environ.get("PROBE_PG_TIMEOUT", "30"))))

    def generation(number: int, members: list[str], host: str) -> None:
        """Form generation ``number`` of ``members`` (rank = position) on a store hosted by ``host``."""
        coord.set(f"handle/{number}/{name}", group.handle)
        handles = [coord.get(f"handle/{number}/{member}").decode() for member in members]
        store_port = int(coord.get(f"store/{number}")) if name != host else None
        if name == host:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
            coord.set(f"store/{number}", str(store.port))
            generation.hosted.append(store)  # a generation's store lives as long as its host
        else:
            store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=TIMEOUT)
        began = time.monotonic()
        group.reconfigure(number, handles, dist.PrefixStore(f"generation-{number}", store))
        result(f"g{number}", {"rank": dist.get_rank(), "world": dist.get_world_size(),
                              "same_group": dist.distributed_c10d._get_default_group() is group.group,
                              "seconds": time.monotonic() - began})

    generation.hosted = []

    def ddp_step(model: torch.nn.Module, number: int) -> None:
        """One backward through DDP: each rank's gradient is rank + 1, so the averaged one tells
        over how many ranks DDP averaged."""
        model.zero_grad()
        model(torch.full((1, 1), float(dist.get_rank() + 1))).sum().backward()
        result(f"grad{number}", model.module.weight.grad.item())

    def linear() -> torch.nn.Module:
        layer = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        # No collective at the wrap: a joiner wraps alone, the survivors keep theirs.
        return DistributedDataParallel(layer, init_sync=False)

    def collective_after_death(victim: str, tensor: torch.Tensor) -> dict:
        """``victim`` dies at once; the others all-reduce ``tensor``: whether and when it raised."""
        if name == victim:
            coord.set(f"{victim}/dying", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        coord.get(f"{victim}/dying")
        began = time.monotonic()
        try:
            dist.all_reduce(tensor)
            return {"raised": False, "seconds": time.monotonic() - began}
        except RuntimeError as exc:
            return {"raised": True, "seconds": time.monotonic() - began, "error": str(exc)[:200]}

    if scenario == "churn":
        # a, b, c form on c's store; c leaves (nothing pending: a boundary every member agreed on)
        # and exits, taking its store along; a and b shrink on b's; newcomer d joins them on a's.
        if name == "d":
            coord.get("d/start")
            generation(3, ["a", "b", "d"], host="a")
            ddp_step(linear(), 3)
        else:
            generation(1, ["a", "b", "c"], host="c")
            model = linear()
            ddp_step(model, 1)
            coord.set(f"stepped/{name}", "1")
            if name == "c":
                coord.wait(["stepped/a", "stepped/b"])
                return  # out, with generation 1's store
            generation(2, ["a", "b"], host="b")
            ddp_step(model, 2)
            coord.set("d/start", "1")
            generation(3, ["a", "b", "d"], host="a")
            ddp_step(model, 3)
    elif scenario == "failure":
        # a, b, c form; c dies at once; a and b start a collective with it.
        generation(1, ["a", "b", "c"], host="a")
        result("lost_peer", collective_after_death("c", torch.ones(1)))
        group.revoke()
        generation(2, ["a", "b"], host="a")
        ones = torch.ones(1)
        dist.all_reduce(ones)
        result("sum2", ones.item())
    elif scenario == "severed":
        # a, b, c, d form; d dies at once; a, b and c start a collective. Whichever raises first
        # (a neighbour of d) shuts its connections of the generation down, as the runtime does.
        before = GenerationConnections.current()
        generation(1, ["a", "b", "c", "d"], host="a")
        connections = GenerationConnections(name, other_ports={port})
        connections.record_build(before, store_port=None)
        outcome = collective_after_death("d", torch.ones(1000))
        result("lost_peer", {**outcome, "severed": connections.sever() if outcome["raised"] else 0})
        group.destroy()  # a group whose connections were shut down still comes down cleanly
        return
    elif scenario == "freeze":
        # a and b form; b stops answering (the test SIGSTOPs it); a revokes its pending collective.
        generation(1, ["a", "b"], host="a")
        if name == "b":
            coord.set("b/ready", "1")
            time.sleep(600)  # SIGSTOPped and killed by the test
        coord.get("b/stopped")
        work = dist.all_reduce(torch.ones(1), async_op=True)
        time.sleep(0.5)
        began = time.monotonic()
        group.revoke()
        try:
            work.wait()
            result("revoked", {"raised": False, "seconds": time.monotonic() - began})
        except RuntimeError as exc:
            result("revoked", {"raised": True, "seconds": time.monotonic() - began, "error": str(exc)[:200]})
        generation(2, ["a"], host="a")
        alone = torch.ones(1)
        dist.all_reduce(alone)
        result("alone", alone.item())
    # Out together: a generation's store goes with its host, and a peer still in a collective
    # would see its connection close.
    coord.set(f"done/{name}", "1")
    coord.wait([f"done/{member}" for member in sys.argv[4].split(",")])


if __name__ == "__main__":
    main()
