"""The accelerate loop of docs/huggingface.md ("A loop of your own on accelerate, in hot mode"):
accelerate's tutorial form, its loop made the function elasticctl re-enters for every generation.

Below the marker: the page's code block, as written (the guide's unit tests check they are the
same; tests/process/test_frameworks.py runs this file under `elasticctl up --recovery hot` through
a node's SIGKILL and another's join).
"""

# -- the page's code block --------------------------------------------------------------------
import argparse

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import elasticctl.train as elastic
from elasticctl.integrations.accelerate import Accelerator, unwrapped  # was: from accelerate import Accelerator


class CountingTokens(Dataset):  # a random first token, then counting on: a sequence to learn
    def __len__(self):
        return 512

    def __getitem__(self, i):
        first = torch.randint(0, 128, (1,), generator=torch.Generator().manual_seed(i))
        tokens = (first + torch.arange(16)) % 128
        return {"input_ids": tokens, "labels": tokens}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    dataset = CountingTokens()
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = elastic.State(model, optimizer, sampler=elastic.ResumableSampler(dataset))

    def train(state, group):  # was: the loop at the top level; now re-entered for every generation
        accelerator = Accelerator(group)  # this generation's: its DDP on the generation's group
        model = accelerator.prepare(state.model)
        dataloader = DataLoader(dataset, batch_size=8, sampler=state.sampler)  # was: accelerator.prepare(...)
        while state.sampler.epoch < args.epochs:
            for batch in dataloader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                state.commit(samples=len(batch["input_ids"]), loss=loss.item())  # was: optimizer.step(), zero_grad()
            state.sampler.set_epoch(state.sampler.epoch + 1)

    elastic.run(state, train, wrap=unwrapped, checkpoint_every=10)  # the model's DDP is accelerate's


if __name__ == "__main__":
    main()
