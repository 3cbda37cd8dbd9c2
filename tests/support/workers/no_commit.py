"""A trainer that never calls state.commit: its function waits until the
file named by argv[1] exists, then returns at step 0. argv[2]: the runtime's no_step_warning."""

import os
import sys
import time

import torch

import elasticctl.train as elastic

stop_file, warn_after = sys.argv[1], float(sys.argv[2])
state = elastic.State(torch.nn.Linear(2, 2))


def train(state: elastic.State, group: elastic.Group) -> None:
    print("training function entered", flush=True)
    while not os.path.exists(stop_file):
        time.sleep(0.05)


elastic.run(state, train, no_step_warning=warn_after)
print(f"run returned at step {state.step}", flush=True)
