"""elasticctl: elastic multi-node PyTorch training with a native etcd v3 rendezvous.

Importing the package stays cheap (no torch): the CLI and the etcd helpers import
only what they use, and torch-dependent parts live in their own modules.
"""

# The one place the version is written: the package metadata reads it (pyproject.toml's
# `dynamic = ["version"]`), and so does `elasticctl --version`.
__version__ = "0.1.0"
