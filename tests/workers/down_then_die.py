"""A worker that asks for `down` and then kills its torchrun agent at once.

It wins the race that made a node exit 1 on `down` in 1 of 12 runs: torchrun is gone
before the node's periodic look at etcd has seen the request.
"""

import os
import signal
import sys

from elasticctl.etcd.client import EtcdClient, EtcdSettings
from elasticctl.job.registry import Registry

client = EtcdClient(EtcdSettings.from_string(os.environ["ELASTICCTL_ETCD"]))
Registry(client, os.environ["ELASTICCTL_JOB"], os.environ["ELASTICCTL_KEY_PREFIX"]).request_down()
os.kill(os.getppid(), signal.SIGKILL)
sys.exit(1)
