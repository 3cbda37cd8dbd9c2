"""A worker that asks for `down` and then kills its torchrun agent at once.

It wins the race that made a node exit 1 on `down` in 1 of 12 runs: torchrun is gone
before the node's periodic look at etcd has seen the request.
"""

import os
import signal
import sys

from elasticctl.etcd.client import EtcdClient
from elasticctl.job.environment import WorkerEnvironment
from elasticctl.job.registry import Registry

environment = WorkerEnvironment.from_env()
client = EtcdClient(environment.etcd_settings(retry_timeout=30.0))
Registry(client, environment.job, environment.key_prefix).request_down()
os.kill(os.getppid(), signal.SIGKILL)
sys.exit(1)
