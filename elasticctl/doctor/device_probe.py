"""The ``devices`` admission check's probe, run in its own process (``python -m
elasticctl.doctor.device_probe``, by :func:`elasticctl.doctor.gather.gather_devices`, with a
timeout): the CLI never imports torch, and a hung GPU must not hang the node.

A small float32 matmul on each visible CUDA device is compared with the CPU's; with two or more
devices, an NCCL all-reduce across them in this one process (``torch.cuda.nccl.all_reduce``:
no process group, no port). Prints one JSON line (read by
:func:`elasticctl.doctor.checks.parse_device_probe`)::

    {"devices": [{"index": 0, "name": "...", "error": 1.2e-07}, ...],
     "collective": {"status": "pass" | "fail" | "skipped", "detail": "..."},
     "failure": null}

GPU-only: with no CUDA device the check is skipped before this runs.
"""

from __future__ import annotations

import json
import sys

SIZE = 256


def _matmul(torch, index: int, a, b, expected, scale: float) -> dict:
    name = ""
    try:
        name = torch.cuda.get_device_name(index)
        device = torch.device("cuda", index)
        got = (a.to(device) @ b.to(device)).cpu()
        return {"index": index, "name": name, "error": float((got - expected).abs().max().item() / scale)}
    except Exception as exc:  # a device that fails is the finding, not a crash of the probe
        return {"index": index, "name": name, "failure": f"{type(exc).__name__}: {exc}"[:300]}


def _all_reduce(torch, count: int) -> dict:
    if count < 2:
        return {"status": "skipped", "detail": "one GPU: nothing to all-reduce with"}
    try:
        from torch.cuda import nccl

        tensors = [torch.full((1024,), float(i + 1), device=torch.device("cuda", i)) for i in range(count)]
        if not nccl.is_available(tensors):
            return {"status": "skipped", "detail": "this torch build has no NCCL"}
        nccl.all_reduce(tensors)
        want = count * (count + 1) / 2
        wrong = [i for i, t in enumerate(tensors) if not bool((t.cpu() == want).all())]
        if wrong:
            return {"status": "fail", "detail": f"GPU(s) {', '.join(map(str, wrong))} hold a wrong sum"}
        return {"status": "pass", "detail": f"NCCL all-reduce across {count} GPUs"}
    except Exception as exc:
        return {"status": "fail", "detail": f"{type(exc).__name__}: {exc}"[:300]}


def probe() -> dict:
    try:
        import torch
    except Exception as exc:
        return {"failure": f"torch cannot be imported: {exc}"[:300]}
    if not torch.cuda.is_available():
        return {"failure": f"torch {torch.__version__} cannot use CUDA (a CPU build, or a driver too old for it)"}
    torch.backends.cuda.matmul.allow_tf32 = False  # the CPU computes in full float32 too
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(SIZE, SIZE, generator=generator) * 2 - 1
    b = torch.rand(SIZE, SIZE, generator=generator) * 2 - 1
    expected = a @ b
    scale = float(expected.abs().max().item()) or 1.0
    count = torch.cuda.device_count()
    return {"devices": [_matmul(torch, i, a, b, expected, scale) for i in range(count)],
            "collective": _all_reduce(torch, count)}


def main() -> int:
    print(json.dumps(probe()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
