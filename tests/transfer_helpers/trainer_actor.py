"""A trainer stand-in for transfer tests: holds a real HF model (transformers) and sends its
parameters in HF order. Weights are perturbed deterministically to play "one optimizer step"."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rlplacement.runtime.one_at_a_time import one_call_at_a_time
from rlplacement.transfer.base import tensor_checksum
from rlplacement.runtime.trainer_transfer import TrainerTransferMixin


@one_call_at_a_time  # as the real trainer actor: a compiled update graph sends from another thread
class StandInHFTrainer(TrainerTransferMixin):
    def __init__(self, model_dir: str):
        import torch
        import transformers

        torch.set_num_threads(1)
        self.model_dir = model_dir
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.delay_s = 0.0
        self.fail_after: int | None = None

    def perturb(self, seed: int, scale: float = 0.02) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in self.model.named_parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)

    def set_slow(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def set_fail_after(self, n: int | None) -> None:
        self.fail_after = n

    def hf_named_tensors(self):
        for i, (name, p) in enumerate(self.model.named_parameters()):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError(f"simulated gather failure at tensor {i}")
            if self.delay_s:
                time.sleep(self.delay_s)
            yield name, p.detach()

    def checksums(self) -> dict[str, str]:
        return {n: tensor_checksum(p) for n, p in self.model.named_parameters()}

    def tensor_bytes(self) -> dict[str, int]:
        return {n: p.numel() * p.element_size() for n, p in self.model.named_parameters()}

    def fused_group_bytes(self) -> dict[str, int]:
        """Bytes per fused group (q/k/v, gate/up), as the sender keeps them in one bucket."""
        from rlplacement.transfer.bucket import fused_group_of

        groups: dict[str, int] = {}
        for n, nbytes in self.tensor_bytes().items():
            groups[fused_group_of(n)] = groups.get(fused_group_of(n), 0) + nbytes
        return groups

    def save_hf(self, out_dir: str) -> str:
        """The current weights as an HF folder (config and tokenizer copied from the original)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        for f in Path(self.model_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(f, out / f.name)
        return str(out)


@one_call_at_a_time
class StandInRowsTrainer(StandInHFTrainer):
    """A stand-in for rank ``rank`` of a ``world``-rank FSDP trainer where every rank sends (``transfer.pieces``):
    it holds the whole model (the same weights as every other stand-in rank given the same ``perturb``) and
    sends only its rows of every tensor (FSDP2's ``Shard(0)`` split), as pieces."""

    def __init__(self, model_dir: str, rank: int, world: int):
        super().__init__(model_dir)
        self.rank, self.world = rank, world

    def hf_named_tensors(self):
        from rlplacement.transfer.pieces import row_pieces

        for name, p in self.model.named_parameters():
            for index, key, rows in row_pieces(name, p.detach(), self.world):
                if index == self.rank:
                    yield key, rows
