"""Environment variables that cross a process boundary inside elasticctl, each named once.

The node (elasticctl) sets them for torchrun, the rendezvous handler inside torchrun sets
them for the workers; trainers read them through :mod:`elasticctl.worker`.
"""

NODE = "ELASTICCTL_NODE"                  # this node's id in the job
RESTARTS = "ELASTICCTL_RESTARTS"          # restarts this node's own failures have spent
WORKER_MARKS = "ELASTICCTL_WORKER_MARKS"  # where workers mark started-N / done-N (worker_entry)
