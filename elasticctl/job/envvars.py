"""Environment variables elasticctl reads or sets across a process boundary, each named once.

The node (elasticctl) sets them for torchrun, the rendezvous handler inside torchrun sets
some for the workers; trainers read them through :mod:`elasticctl.worker` and
:mod:`elasticctl.progress`. (Every CLI flag can also come from ``ELASTICCTL_<FLAG>``:
click derives those from the flag names.)
"""

NODE = "ELASTICCTL_NODE"                  # this node's id in the job
RESTARTS = "ELASTICCTL_RESTARTS"          # restarts this node's own failures have spent
WORKER_MARKS = "ELASTICCTL_WORKER_MARKS"  # where workers mark started-N / done-N (worker_entry)
JOB = "ELASTICCTL_JOB"
ETCD = "ELASTICCTL_ETCD"                  # etcd endpoints, with their scheme
KEY_PREFIX = "ELASTICCTL_KEY_PREFIX"
CHECKPOINT_DIR = "ELASTICCTL_CHECKPOINT_DIR"
ETCD_PASSWORD = "ELASTICCTL_ETCD_PASSWORD"  # never a flag: it would show in `ps`
RDZV_SECRET = "ELASTICCTL_RDZV_SECRET"
ETCD_BINARY = "ELASTICCTL_ETCD_BINARY"
STATE_DIR = "ELASTICCTL_STATE_DIR"


def etcd_tls(name: str) -> str:
    """ELASTICCTL_ETCD_CACERT / _CERT / _KEY / _USER: how workers reach etcd like their node."""
    return f"ELASTICCTL_ETCD_{name.upper()}"
