"""The Megatron backend's training checkpoints (``--save``/``--load`` of a ``--save`` folder): the whole
training state written and read with megatron's ``dist_checkpointing``, so a checkpoint resumes at another
TP/PP/DP as megatron's own do.

Mixed into :class:`~.backend.MegatronBackend`, whose ``model``, ``reference``, ``lora``, ``optimizer``,
``description`` and megatron training machinery (``_training``) it reads. Invariants: collective (every rank
saves and loads its own shards); a checkpoint is published whole or not at all (``train_checkpoint.publish``);
under LoRA it holds the adapters alone, the frozen base being the model folder's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlplacement.backends.base import TrainerBackend
from rlplacement.errors import ConfigError


class MegatronCheckpoints(TrainerBackend):
    """:meth:`save_checkpoint` and :meth:`load_checkpoint` through megatron's ``dist_checkpointing``."""

    def save_checkpoint(self, root: str, weight_version: int, job_state: dict[str, Any] | None = None) -> str:
        """Collective: the whole training state under ``root`` with megatron's ``dist_checkpointing`` (the
        model, the optimizer's main parameters and state, the frozen reference; reshardable to another
        TP/PP/DP as megatron's own checkpoints are), plus the counters and RNG, published whole
        (``train_checkpoint.publish``, with checksums and the model's identity); the model's description at the
        root (``checkpoint_layout.describe``); ``job_state`` as the base class keeps it."""
        from megatron.core import dist_checkpointing

        from rlplacement.backends.megatron import checkpoint_layout as layout
        from rlplacement.backends import train_checkpoint

        def write(tmp: Path) -> None:
            if dist.get_rank() == 0:
                layout.describe(root, *self.description)
            dist_checkpointing.save(self._sharded_state_dict(loading=False), str(tmp))

        state = self._saved_state(weight_version, job_state, kl_reference=self.reference is not None,
                                  **self.lora_checkpoint_state())
        return str(train_checkpoint.publish(root, self.train_calls, write, state, self.model_identity()))

    def load_checkpoint(self, root: str) -> dict[str, Any]:
        """Collective: resume from the last checkpoint under ``root`` (see :meth:`save_checkpoint`), checked
        first against its manifest and :attr:`source_hf_dir`'s model (``train_checkpoint.verified``)."""
        from megatron.core import dist_checkpointing

        from rlplacement.backends import train_checkpoint

        @torch.no_grad()  # the loads copy into parameters and views of them
        def read(folder: Path) -> None:
            saved = train_checkpoint.read_state(folder)
            if self.reference is not None and self.lora is None and not saved.get("kl_reference"):
                raise ConfigError(f"--use-kl-loss with --load {root}: that run had no --use-kl-loss, so its "
                                  f"checkpoint holds no reference model to pull towards; drop --use-kl-loss, or "
                                  f"start from the converted checkpoint with it")
            self._refuse_other_checkpoint_kind(saved, root)
            self._training.ensure_optimizer_state(adam_step=saved["step"])
            loaded = dist_checkpointing.load(self._sharded_state_dict(loading=True), str(folder))
            if self.lora is not None:
                from rlplacement.backends.megatron.lora import load_state

                load_state(self.model, loaded["model"], folder)
            else:
                _load_model_state(self.model, loaded["model"], folder)
            if self.reference is not None and self.lora is None:
                _load_model_state(self.reference, {k.removeprefix("reference."): v
                                                   for k, v in loaded["reference"].items()}, folder)
            self._training.load_optimizer_state(loaded["optimizer"])

        state = train_checkpoint.restore(train_checkpoint.latest(root), read, self.source_hf_dir)
        return self._resumed_from(state)

    def _sharded_state_dict(self, loading: bool) -> dict:
        """What a checkpoint holds, as megatron's training lays it out: the distributed optimizer's state
        ``dp_reshardable`` (its default there: one tensor per buffer, resumable at another DP size; the
        model itself at any TP/PP). Under LoRA the model is its adapters alone
        (:func:`.lora.sharded_state_dict`)."""
        if self.lora is not None:  # the adapters alone: the base is the HF folder's, named by the identity
            from rlplacement.backends.megatron.lora import sharded_state_dict

            model = sharded_state_dict(self.model)
        else:
            model = self.model.sharded_state_dict()
        out = {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        if self.reference is not None and self.lora is None:  # LoRA's reference is the HF folder's base
            out["reference"] = self.reference.sharded_state_dict(prefix="reference.")
        return out


def _load_model_state(model, state: dict, folder: Path) -> None:
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{folder}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
