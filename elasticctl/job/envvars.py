"""Environment variables elasticctl reads or sets across a process boundary, each named once.

The node (elasticctl) sets them for torchrun, the rendezvous handler inside torchrun sets
some for the workers; trainers read them through :mod:`elasticctl.train.script` and
:mod:`elasticctl.job.progress`. (Every CLI flag can also come from ``ELASTICCTL_<FLAG>``:
click derives those from the flag names.)
"""

NODE = "ELASTICCTL_NODE"                  # this node's id in the job
RESTARTS = "ELASTICCTL_RESTARTS"          # restarts this node's own failures have spent
WORKER_MARKS = "ELASTICCTL_WORKER_MARKS"  # where workers mark started-N / done-N (elasticctl.train.entry)
JOB = "ELASTICCTL_JOB"
ETCD = "ELASTICCTL_ETCD"                  # etcd endpoints, with their scheme
KEY_PREFIX = "ELASTICCTL_KEY_PREFIX"
CHECKPOINT_DIR = "ELASTICCTL_CHECKPOINT_DIR"
ETCD_PASSWORD = "ELASTICCTL_ETCD_PASSWORD"  # never a flag: it would show in `ps`
RDZV_SECRET = "ELASTICCTL_RDZV_SECRET"
ETCD_BINARY = "ELASTICCTL_ETCD_BINARY"
STATE_DIR = "ELASTICCTL_STATE_DIR"
HOT = "ELASTICCTL_HOT"                    # hot recovery's settings for the workers (settings.HotSettings)
NODE_ADDR = "ELASTICCTL_NODE_ADDR"        # the address this node's workers are reached at


def etcd_tls(name: str) -> str:
    """ELASTICCTL_ETCD_CACERT / _CERT / _KEY / _USER: how workers reach etcd like their node."""
    return f"ELASTICCTL_ETCD_{name.upper()}"


def etcd_settings(retry_timeout: float):
    """How a worker reaches its job's etcd (like its node does), or None outside elasticctl."""
    import os

    from elasticctl.etcd.client import EtcdSettings  # grpc only when it is used

    env = os.environ.get
    if not env(ETCD) or not env(JOB):
        return None
    return EtcdSettings.from_string(
        env(ETCD), cacert=env(etcd_tls("cacert")), cert=env(etcd_tls("cert")), key=env(etcd_tls("key")),
        user=env(etcd_tls("user")), password=env(ETCD_PASSWORD), retry_timeout=retry_timeout)


def job_keys():
    """The keys of this worker's job, or None outside elasticctl."""
    import os

    from elasticctl.job.keys import DEFAULT_KEY_PREFIX, JobKeys

    job = os.environ.get(JOB)
    return JobKeys(job, os.environ.get(KEY_PREFIX) or DEFAULT_KEY_PREFIX) if job else None
