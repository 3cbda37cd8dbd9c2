"""Which group carries the runtime's boundary flags and straggler exchange, for a training
group's backend: a table (the why: elasticctl.train.groups.process_group.control_channel).

The groups themselves, built and used per generation: tests/process/test_control_group.py.
"""

from __future__ import annotations

import pytest

from elasticctl.train.groups.process_group import ControlChannel, control_channel

TRAINING, SIDE = ControlChannel.TRAINING_GROUP, ControlChannel.GLOO_SIDE_GROUP


@pytest.mark.parametrize(("backend", "channel"), [
    # gloo on CPU (and gloo with the model on a GPU: the flags are CPU tensors either way): no second group
    ("gloo", TRAINING),
    ("GLOO", TRAINING),                   # torch takes backend names in any case
    ("cpu:gloo", TRAINING),
    # a training group whose CPU tensors already go to gloo, its GPU tensors to NCCL
    ("cpu:gloo,cuda:nccl", TRAINING),
    # NCCL: GPU tensors only; reading a flag there would wait for the device every step
    ("nccl", SIDE),
    ("cuda:nccl", SIDE),
    # other accelerators' backends, and CPU backends whose asynchronous progress is the build's
    ("xccl", SIDE),
    ("mpi", SIDE),
    ("ucc", SIDE),
    ("cpu:mpi,cuda:nccl", SIDE),
])
def test_control_channel(backend, channel):
    assert control_channel(backend) is channel
