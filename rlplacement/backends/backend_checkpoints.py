"""A trainer backend's training checkpoints (``--save``, and ``--load`` of a ``--save`` folder): the whole
training state written under a root, and a run resumed from its latest checkpoint.

Mixed into :class:`~.base.TrainerBackend`, whose ``lora``, ``optimizer``, counters (``train_calls``, ``step``,
``skipped_steps``) and ``source_hf_dir`` it reads. Invariants: collective (every rank calls
:meth:`save_checkpoint` and :meth:`load_checkpoint`); a checkpoint is published atomically with every file's
checksum and the identity of the model it trains, and is refused at load when that identity or its kind
(whole model or LoRA adapters alone) differs from the run's; a backend that writes its checkpoints another
way (megatron's ``dist_checkpointing``) overrides the two methods and keeps the rest.
"""

from __future__ import annotations

from typing import Any

import torch

from rlplacement.errors import ConfigError


class BackendCheckpoints:
    """:meth:`save_checkpoint`, :meth:`load_checkpoint` and the state both record (``trainer_state.json``)."""

    def _checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The module and optimizer a training checkpoint holds (``--save``)."""
        raise ConfigError(f"--save/--load of a training checkpoint: the {self.name} backend does not write one yet")

    def save_checkpoint(self, root: str, weight_version: int, job_state: dict[str, Any] | None = None) -> str:
        """Collective: the whole training state (model, optimizer, schedule position, step counters, RNG,
        the weight version these weights will be served as) under ``root``, published atomically with every
        file's checksum and the model's identity; ``job_state``: the driver's small JSON-able state, given
        back in ``resumed["job_state"]``."""
        from rlplacement.backends import train_checkpoint

        module, optimizer = self._checkpointed()
        state = self._saved_state(weight_version, job_state, **self.lora_checkpoint_state())
        return str(train_checkpoint.save(root, self.train_calls, module, optimizer, state, self.model_identity(),
                                         trainable_only=self.checkpoints_trainable_only))

    @property
    def checkpoints_trainable_only(self) -> bool:
        """A checkpoint holds the trainable parameters alone: under LoRA its adapters, the frozen base being
        the model folder's, which the checkpoint's identity names."""
        return self.lora is not None

    def lora_checkpoint_state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` records of a LoRA run (nothing otherwise, so a full checkpoint's state is
        unchanged): that it holds the trainable parameters alone, and the adapters' settings, which
        ``rlplacement export-hf`` writes as a PEFT config."""
        if self.lora is None:
            return {}
        return {"trainable_only": True, "lora": {**self.lora.live_spec(), "dropout": self.lora.dropout}}

    def _refuse_other_checkpoint_kind(self, saved: dict[str, Any], root: str) -> None:
        """A LoRA run's checkpoint (the adapters alone) loaded without LoRA, or a full one with it: refused."""
        holds_adapters = bool(saved.get("trainable_only", False))
        if holds_adapters != self.checkpoints_trainable_only:
            raise ConfigError(f"--load {root}: its checkpoint holds "
                              + ("the trainable parameters alone (a LoRA run's adapters): resume it with the same "
                                 "--lora-rank flags" if holds_adapters else
                                 "the whole model, not a LoRA run's adapters: resume it without --lora-rank"))

    def _saved_state(self, weight_version: int, job_state: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        """``trainer_state.json``'s content; a ``job_state`` JSON cannot hold is refused before any rank writes."""
        import json

        job_state = dict(job_state or {})
        try:
            json.dumps(job_state)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"save_checkpoint(job_state=...): {exc}; keep it to JSON values (numbers, strings, "
                              f"lists, dicts)") from None
        return {"train_calls": self.train_calls, "step": self.step, "skipped_steps": self.skipped_steps,
                "weight_version": weight_version, **extra, "job_state": job_state}

    def model_identity(self) -> dict[str, Any]:
        """The model a checkpoint of this run records: the identity of the checkpoint it resumed from, else
        of :attr:`source_hf_dir` (``checkpoint_manifest.model_identity``), else {}."""
        if self._identity is None:
            from rlplacement.backends.checkpoint_manifest import model_identity

            self._identity = model_identity(self.source_hf_dir) if self.source_hf_dir else {}
        return self._identity

    def load_checkpoint(self, root: str) -> dict[str, Any]:
        """Collective: resume from the last checkpoint under ``root`` (see :meth:`save_checkpoint`), checked
        first against its manifest and :attr:`source_hf_dir`'s model (``train_checkpoint.verified``)."""
        from rlplacement.backends import train_checkpoint

        module, optimizer = self._checkpointed()
        folder = train_checkpoint.latest(root)
        self._refuse_other_checkpoint_kind(train_checkpoint.read_state(folder), root)
        state = train_checkpoint.load(folder, module, optimizer, self.source_hf_dir,
                                      trainable_only=self.checkpoints_trainable_only)
        return self._resumed_from(state)

    def _resumed_from(self, state: dict[str, Any]) -> dict[str, Any]:
        self.train_calls, self.step, self.skipped_steps = state["train_calls"], state["step"], state["skipped_steps"]
        self._identity = state.pop("model") or None  # the next save records the same model
        self.resumed = state
        return state
