"""The rendezvous records of a job in etcd, read and written here and nowhere else.

* :class:`RoundRecords` — the etcd-native protocol's records (``rdzv/`` for the agents'
  rounds, ``generations/`` for the workers'): each node's declaration, the claim to seal,
  the sealed round and ``closed``, with the compare-and-swap writes the protocol relies on
  and the two prefixes its view watches (:mod:`elasticctl.rendezvous.view`).
* :class:`StoreRecords` — the keys of one c10d store (``store/<round>/``), what
  :class:`elasticctl.rendezvous.backend.EtcdStore` is built on.
* :class:`TorchStateRecord` — torch's own rendezvous state (``rdzv``), for
  :class:`elasticctl.rendezvous.backend.EtcdRendezvousBackend`.

Records are signed with the job secret where there is one (:mod:`elasticctl.job.records`);
what a record means to the protocol is decided by its users, not here.
"""

from __future__ import annotations

from collections.abc import Callable

from elasticctl.etcd.client import EtcdClient, KeyValue
from elasticctl.etcd.lease import Lease
from elasticctl.etcd.watch import PrefixWatch
from elasticctl.job.keys import JobKeys, name_under
from elasticctl.job.records import Claim, Declaration, Reform, Round


class RecordFeed(PrefixWatch):
    """One watched prefix of rendezvous records: its full reads go to ``load(kvs, revision)``,
    its watch responses to ``apply(response)``."""

    def __init__(self, client: EtcdClient, prefix: str, load: Callable, apply: Callable) -> None:
        super().__init__(client, prefix)
        self._on_load, self._on_apply = load, apply

    def _load(self, kvs: list[KeyValue], revision: int) -> None:
        self._on_load(kvs, revision)

    def _apply(self, response) -> None:
        self._on_apply(response)


class RoundRecords:
    """The records of one run's rounds under ``keys.rdzv`` (see the module docstring)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, secret: bytes | None = None) -> None:
        self._client = client
        self.keys = keys
        self._secret = secret or None  # with a job secret, records are signed and unsigned ones ignored
        self.nodes_prefix = keys.rdzv_nodes
        self.ctl_prefix = keys.rdzv_ctl
        self.round_key = keys.rdzv_round
        self.closed_key = keys.rdzv_closed
        self.claim_key = keys.rdzv_sealer
        self.reform_key = keys.rdzv_reform

    @property
    def retry_timeout(self) -> float:
        """How long one etcd request may keep retrying: what waiting on a load may take."""
        return self._client.settings.retry_timeout

    # -- the watched prefixes ------------------------------------------------------------

    def ctl_feed(self, load: Callable, apply: Callable) -> RecordFeed:
        """The watch of ``ctl/``: the sealed round, ``closed``, the claim and the re-form record
        (not started)."""
        return RecordFeed(self._client, self.ctl_prefix, load, apply)

    def nodes_feed(self, load: Callable, apply: Callable) -> RecordFeed:
        """The watch of ``nodes/``: every node's declaration (not started)."""
        return RecordFeed(self._client, self.nodes_prefix, load, apply)

    # -- reading a record ----------------------------------------------------------------

    def declaration_at(self, key: bytes, value: bytes, revision: int) -> tuple[str, Declaration | None]:
        """The node a ``nodes/`` key names, and its declaration if ``value`` is one it wrote."""
        name = key.decode(errors="replace")
        node = name_under(self.nodes_prefix, name)
        declaration = Declaration.from_json(value, revision, name, self._secret)
        # A record under another node's name is not that node's declaration.
        return node, declaration if declaration is not None and declaration.node == node else None

    def round_from(self, value: bytes, revision: int) -> Round | None:
        """The round in the round key's ``value`` (at ``revision``), if it is readable and signed."""
        return Round.from_json(value, revision, self.round_key, self._secret)

    def claim_from(self, value: bytes) -> Claim | None:
        return Claim.from_json(value, self.claim_key, self._secret)

    def reform_from(self, value: bytes, revision: int) -> Reform | None:
        """The re-form record in ``value`` (at ``revision``), if it is readable and signed."""
        return Reform.from_json(value, revision, self.reform_key, self._secret)

    # -- the protocol's writes -----------------------------------------------------------

    def declare(self, declaration: Declaration, lease: int) -> int:
        """Put this node's declaration, bound to its lease; returns the new revision."""
        key = self.keys.rdzv_node(declaration.node)
        return self._client.put(key, declaration.to_json(key, self._secret), lease=lease)

    def declare_and_claim(self, declaration: Declaration, claim: Claim, expected_revision: int,
                          lease: int) -> tuple[bool, int]:
        """:meth:`declare`, and :meth:`claim_sealing` in the same transaction (one raft proposal
        for both). Returns whether the claim was taken, and the mod revision of the claim key
        then: this claim's, or the one that stood in its way (0: absent)."""
        key = self.keys.rdzv_node(declaration.node)
        claimed, current = self._client.put_and_compare_and_swap(
            key, declaration.to_json(key, self._secret), self.claim_key,
            claim.to_json(self.claim_key, self._secret), expected_revision, lease)
        return claimed, 0 if current is None else current.mod_revision

    def withdraw(self, node: str) -> None:
        self._client.delete(self.keys.rdzv_node(node))

    def claim_sealing(self, claim: Claim, expected_revision: int, lease: int) -> bool:
        """Claim the sealing of ``claim.round`` for ``claim.node`` if the claim key is still at
        ``expected_revision`` (0: absent); bound to the node's lease, so it ends with the node."""
        ok, _, _ = self._client.compare_and_swap(
            self.claim_key, claim.to_json(self.claim_key, self._secret), expected_revision, lease)
        return ok

    def seal(self, sealed: Round, expected_revision: int, lease: int | None = None) -> bool:
        """Seal ``sealed`` if the round key is still at ``expected_revision``, and release the
        claim, in one transaction. ``lease``: the run's, so an abandoned run's round expires."""
        ok, _, _ = self._client.compare_and_swap(
            self.round_key, sealed.to_json(self.round_key, self._secret), expected_revision, lease,
            also_delete=self.claim_key)
        return ok

    def publish_reform(self, reform: Reform, expected_revision: int, lease: int | None = None) -> bool:
        """Write ``reform`` if the re-form key is still at ``expected_revision`` (0: absent): of
        two followers that see the same change, one writes it. ``lease``: the run's."""
        ok, _, _ = self._client.compare_and_swap(
            self.reform_key, reform.to_json(self.reform_key, self._secret), expected_revision, lease)
        return ok

    def restore(self, known: Round, expected_revision: int, lease: int | None = None) -> bool:
        """Write ``known`` back over what the round key holds at ``expected_revision`` (0: absent)."""
        ok, _, _ = self._client.compare_and_swap(
            self.round_key, known.to_json(self.round_key, self._secret), expected_revision, lease)
        return ok

    def close(self, lease: int | None = None) -> None:
        """The run is done: no round after this one."""
        self._client.put(self.closed_key, "1", lease=lease)


class StoreRecords:
    """The keys of one c10d store under ``prefix``, each written bound to ``lease``.

    Names are the store's own keys (any text torch chooses), below the prefix.
    """

    def __init__(self, client: EtcdClient, prefix: str, lease: Lease) -> None:
        self._client = client
        self.prefix = prefix.rstrip("/").encode() + b"/"
        self._lease = lease

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def read(self, name: str) -> KeyValue | None:
        return self._client.get(self.key(name))

    def write(self, name: str, value: bytes) -> None:
        self._lease.put(self.key(name), value)

    def swap(self, name: str, value: bytes, expected_revision: int) -> tuple[bool, KeyValue | None]:
        """Write ``value`` if ``name`` is still at ``expected_revision`` (0: absent); on failure,
        what it holds now (None: absent)."""
        full_key = self.key(name)
        succeeded, current, _ = self._lease.bound(
            lambda lease_id: self._client.compare_and_swap(full_key, value, expected_revision, lease_id))
        return succeeded, current

    def delete(self, name: str) -> bool:
        return self._client.delete(self.key(name))

    def count(self) -> int:
        return self._client.count_prefix(self.prefix)


class TorchStateRecord:
    """torch's rendezvous state of a run, in one key bound to ``lease``; its ``mod_revision``
    is torch's fencing token."""

    def __init__(self, client: EtcdClient, keys: JobKeys, lease: Lease) -> None:
        self._client = client
        self.key = keys.torch_state
        self._lease = lease

    def read(self) -> KeyValue | None:
        return self._client.get(self.key)

    def swap(self, sealed: bytes, expected_revision: int) -> tuple[bool, KeyValue | None]:
        """Write ``sealed`` if the key is still at ``expected_revision`` (0: absent); returns
        whether it did, and the key as it is now (the new one, or the one that won)."""
        succeeded, current, _ = self._lease.bound(
            lambda lease_id: self._client.compare_and_swap(self.key, sealed, expected_revision, lease_id))
        return succeeded, current
