"""The Hugging Face script of docs/huggingface.md: transformers' tutorial form, with elasticctl's
``Trainer`` imported instead of transformers' (and a model built from a config: nothing is
downloaded).

Below the marker: the page's code block, as written (the guide's unit tests check they are the
same; tests/process/test_frameworks.py runs this file under `elasticctl up` through a node's
SIGKILL, another's join and its leave).
"""

# -- the page's code block --------------------------------------------------------------------
import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from elasticctl.integrations.huggingface import Trainer  # was: from transformers import Trainer


class CountingTokens(Dataset):  # a random first token, then counting on: a sequence to learn
    def __len__(self):
        return 512

    def __getitem__(self, i):
        first = torch.randint(0, 128, (1,), generator=torch.Generator().manual_seed(i))
        tokens = (first + torch.arange(16)) % 128
        return {"input_ids": tokens, "labels": tokens}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--batch-policy", default="framework")  # or linear, constant-batch
    args = parser.parse_args()

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=16))
    training = TrainingArguments(output_dir="checkpoints", num_train_epochs=args.epochs, per_device_train_batch_size=8,
                                 save_strategy="steps", save_steps=10, logging_steps=50, report_to=[],
                                 learning_rate=1e-3)
    Trainer(model=model, args=training, train_dataset=CountingTokens(), batch_policy=args.batch_policy).train()


if __name__ == "__main__":
    main()
