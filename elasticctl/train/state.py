"""What a hot-recovery job keeps in memory and hands to joiners: :class:`State`.

The state is the model, the optimizer, the LR scheduler, the AMP gradient scaler and the
sampler (anything with ``state_dict``/``load_state_dict``), the step, and user fields. In hot
recovery it travels between workers tensor by tensor (:mod:`elasticctl.train.state_transfer.transfer`);
:meth:`State.to_bytes` / :meth:`State.load_bytes` keep the whole-state blob (read with
``weights_only=True``, torch's allow-list unpickler: a peer can send wrong numbers, never code)
for tools and the transfer benchmark's comparison.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from elasticctl.errors import ConfigError, ElasticctlError
from elasticctl.train import entry as worker_entry


class StateError(ElasticctlError):
    """A state blob that does not fit this worker's objects."""


class State:
    """The training state the runtime keeps consistent across workers and generations.

    ``fields`` are plain values (numbers, strings, tensors, lists and dicts of them) the
    script wants carried along, such as samples seen; read and write them as attributes
    (``state.samples_seen += n``). ``step`` counts committed steps.

    ``peer_copies=K`` (hot mode, a model sharded without replicas): every K steps each worker
    sends a copy of its shards to a buddy on another node, so that a lost node is restored from
    memory, re-doing at most K steps (:mod:`elasticctl.train.sharding.buddy_copies`; 0: no copies).
    """

    _OBJECTS = ("model", "optimizer", "scheduler", "scaler", "sampler")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 scheduler: Any = None, scaler: torch.amp.GradScaler | None = None, sampler: Any = None,
                 peer_copies: int = 0, **fields: Any) -> None:
        if type(peer_copies) is not int or peer_copies < 0:
            raise ConfigError(f"State(peer_copies={peer_copies!r}): the copy interval must be a whole number of "
                              "steps, 0 (no copies) or more.")
        object.__setattr__(self, "_fields", dict(fields))
        object.__setattr__(self, "peer_copies", peer_copies)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler  # stepped by every commit: a per-step schedule
        self.scaler = scaler
        self.sampler = sampler
        self.step = 0
        self.live = False  # holds trained state (restored, received, or the job's first)
        self._runtime: Any = None

    def __getattr__(self, name: str) -> Any:
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(f"The training state has no field '{name}'.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._fields:
            self._fields[name] = value
        else:
            object.__setattr__(self, name, value)

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self._fields)

    def update_fields(self, values: dict[str, Any]) -> None:
        """Take ``values`` for these fields (a checkpoint's, on resume)."""
        self._fields.update(values)

    def bind(self, runtime: Any) -> None:
        """The runtime that :meth:`commit` and :meth:`checkpoint` report to (elasticctl.train.runtime)."""
        self._runtime = runtime
        worker_entry.note_steps_counted()  # a failure before the first commit is then known as such

    def commit(self, samples: int = 0, loss: float | None = None) -> None:
        """End a training step: apply the gradients (``optimizer.step``, ``zero_grad``, the
        scheduler), advance the sampler by ``samples`` per worker, count the step (``loss``
        goes to ``elasticctl status`` and is checked: a NaN or infinity here, or in the
        gradients, names the rank that produced it, and with ``--skip-non-finite 1`` the
        gradients are not applied, on every rank; the step still counts). The step is a boundary
        where the membership may change: the runtime then leaves the script's function and
        re-enters it in the next generation, with this state."""
        apply = self._runtime.before_step_applied(loss) if self._runtime is not None else True
        if self.optimizer is not None and apply:
            if self.scaler is not None:  # mixed precision: unscale, skip the step on inf/NaN gradients
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.sampler is not None and samples:
            ledger = getattr(self._runtime, "ledger", None)
            if ledger is not None and hasattr(self.sampler, "upcoming_step"):  # ELASTICCTL_SAMPLE_LEDGER
                # the whole step's samples: a rank killed after the step's all-reduce leaves no line
                # of its own, yet its samples were trained (their gradients are in every survivor's)
                ledger.stepped(self.step + 1, self.sampler.epoch, self.sampler.upcoming_step(samples), loss)
            self.sampler.advance(samples)
        self.step += 1
        worker_entry.note_step()  # its node then judges a failure as one after training began
        if self._runtime is not None:
            self._runtime.step_done(samples, loss)

    def checkpoint(self) -> None:
        """Write a durable checkpoint of the state now, if the job has a checkpoint directory
        (every worker calls it at the same point, e.g. an epoch's end; periodic ones need not:
        the runtime writes those every ``checkpoint_every`` steps)."""
        if self._runtime is not None:
            self._runtime.checkpoint_now()

    # -- moving it -----------------------------------------------------------------------

    def objects(self) -> dict[str, Any]:
        """The stateful objects that are set, by name (the names checkpoints use)."""
        return {name: getattr(self, name) for name in self._OBJECTS if getattr(self, name) is not None}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "fields": dict(self._fields),
                **{name: obj.state_dict() for name, obj in self.objects().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self.objects().items():
            if name not in state:
                raise StateError(f"The state received has no '{name}'.")
            try:
                obj.load_state_dict(state[name])
            except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
                raise StateError(f"The '{name}' state received does not fit this worker's: {exc}") from exc
        fields = state.get("fields", {})
        if not isinstance(fields, dict):
            raise StateError("The fields of the state received are not a mapping.")
        self._fields.update(fields)
        self.step = int(state["step"])
        self.live = True

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes, device: torch.device) -> None:
        try:
            state = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)
        except Exception as exc:  # whatever a malformed blob makes torch raise
            raise StateError(f"The state received cannot be read: {exc}") from exc
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise StateError("The state received is not a training state.")
        self.load_state_dict(state)
