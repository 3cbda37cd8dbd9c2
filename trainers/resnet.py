"""torchvision ResNet-18/50 on an ImageFolder tree, elastic, with AMP on GPU.

``--data-dir`` holds ``train/<class>/*.jpg`` and ``val/<class>/*.jpg`` (the
ImageNet layout). Training, checkpointing, resume at any world size, SIGTERM
handling, the LR policy and hot recovery are the same as trainers/cifar10.py,
whose training loop (on elasticctl's runtime) this script reuses. Mixed precision (float16 autocast with a GradScaler)
is on when the worker has a GPU; ``--no-amp`` turns it off.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import elasticctl  # noqa: F401
except ImportError:  # run from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from cifar10 import (  # trainers/ is the script's directory
    add_training_flags,
    check_training_flags,
    fit,
)

from elasticctl.errors import ConfigError
from elasticctl.train.script import run_main

ARCHS = ("resnet18", "resnet50")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="ImageFolder root with train/ and val/")
    parser.add_argument("--arch", choices=ARCHS, default="resnet50")
    parser.add_argument("--image-size", type=int, default=224, help="training crop size")
    parser.add_argument("--no-amp", action="store_true", help="no mixed precision even on GPU")
    add_training_flags(parser, batch_size=64, lr=0.025, epochs=90)
    args = parser.parse_args(argv)
    check_training_flags(parser, args)
    if args.image_size < 32:
        parser.error(f"--image-size ({args.image_size}) must be at least 32.")
    return args


def image_folders(args: argparse.Namespace):
    from torchvision import datasets, transforms

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_transform = transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize,
    ])
    val_transform = transforms.Compose([
        transforms.Resize(int(args.image_size * 256 / 224)), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), normalize,
    ])
    folders = []
    for split, transform in (("train", train_transform), ("val", val_transform)):
        root = os.path.join(args.data_dir, split)
        try:
            folders.append(datasets.ImageFolder(root, transform))
        except (FileNotFoundError, OSError) as exc:
            raise ConfigError(f"The image folder '{root}' cannot be read: {exc}.") from exc
    return folders


def train(args: argparse.Namespace) -> None:
    import torchvision

    train_set, val_set = image_folders(args)
    model = getattr(torchvision.models, args.arch)(num_classes=len(train_set.classes))
    fit(args, model, train_set, val_set, amp=torch.cuda.is_available() and not args.no_amp)


def main() -> None:
    run_main(train, parse_args())


if __name__ == "__main__":
    main()
