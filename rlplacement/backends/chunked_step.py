"""One optimizer step trained in chunks as a rollout's groups finish (``--train-during-rollout``).

Data flow: :meth:`ChunkedStep.train_chunk` per chunk of finished groups (this rank's share) -> its
micro-batches' forward and backward with loss normaliser 1, gradients accumulating -> after the last chunk
:meth:`ChunkedStep.finish_chunked_step`: the step's response tokens all-reduced, the gradients scaled by
data-parallel size / tokens -> the backend's reduction where it was held back, gradient norm, clipping and
the one optimizer step.

Why it equals the whole-batch step: every term of the objective (policy gradient, KL, entropy, TIS, the
ratio clip) is a sum over response tokens, so the whole step's loss is the sum of the chunks' sums over one
global normaliser; a gradient is linear in its loss, so scaling the accumulated gradient by the normaliser
once, after the last chunk, gives the same gradient (up to float rounding) before the norm, the clip and the
step read it. ``old_logprobs`` a caller computes per chunk equal the whole batch's because no step runs
between chunks. A router loss is over a micro-batch's own tokens, so it is equal only where the chunks'
micro-batches hold the samples the whole batch's hold.

Contracts: every rank of the trainer calls the same chunks in the same order (a chunk's share may be empty on
no rank: each is a collective); nothing else that reads or frees the gradients (a train step, a hand-off, a
checkpoint) runs between the first chunk and :meth:`finish_chunked_step`.
"""

from __future__ import annotations

import dataclasses

import torch

from rlplacement.train_io import Batch


@dataclasses.dataclass
class ChunkSums:
    """What this rank's chunks of the step so far summed: the loss parts and the log-prob sum (``_SUMS`` but
    tokens, normaliser 1), and its response tokens."""

    local: torch.Tensor
    tokens: float = 0.0
    chunks: int = 0


class ChunkedStep:
    """The chunked step of :class:`~rlplacement.backends.base.TrainerBackend` (mixed into it). A backend whose
    framework reduces gradients at each backward (FSDP2: a reduce-scatter per micro-batch, accumulating into
    the sharded gradient) keeps the defaults; one that can hold its reduction back overrides
    :meth:`_begin_chunks`, :meth:`_chunk_gradients` and :meth:`_step_chunks` (megatron: zero once, reduce once)."""

    _chunk_sums: ChunkSums | None = None

    @property
    def chunks_open(self) -> bool:
        """A chunked step has begun and not finished (its gradients are held)."""
        return self._chunk_sums is not None

    def refuse_while_chunks_open(self, what: str, because: str) -> None:
        """Between a chunked step's first chunk and its step the gradients of every chunk so far are held: refuse
        ``what`` (a call that would zero, drop or lose them, ``because``) before any of its work."""
        if self.chunks_open:
            raise RuntimeError(f"{what} while a step of --train-during-rollout holds its chunks' gradients "
                               f"{because}: call RLJob.finish_train_during_rollout() first")

    def train_chunk(self, batch: Batch) -> None:
        """Forward and backward of this rank's share ``batch`` of one chunk, gradients accumulating, no step
        (collective)."""
        batch = self._ready_to_train(batch)
        sums = self._open_chunks()
        sums.local += self._chunk_gradients(batch)
        sums.tokens += float(batch.loss_mask.sum())
        sums.chunks += 1

    def finish_chunked_step(self) -> dict[str, float]:
        """The one optimizer step of the chunks trained since the last (collective); the report
        :meth:`train_step` gives for one step of the same samples. With no chunk at all the step has no
        tokens: its gradient is zero."""
        sums, self._chunk_sums = self._open_chunks(), None
        tokens = self._all_reduce([sums.tokens])[0]
        scale = self.data_parallel_size / max(tokens, 1.0)
        norm, lr = self._step_chunks(scale)
        local = sums.local.clone()
        local[:-1] *= scale  # the loss parts as the whole step's normaliser makes them; the log-prob sum stays a sum
        step_sums = self._step_sums(local, tokens)
        self.train_calls += 1
        return self._train_report(step_sums, steps=1, norm=norm, lr=lr, skipped=int(lr is None),
                                  num_tokens=sums.tokens)

    def _open_chunks(self) -> ChunkSums:
        """The step's sums so far; at its first chunk (or a finish with none), zero and the gradients zeroed."""
        if self._chunk_sums is None:
            self._chunk_sums = ChunkSums(self._zero_local_sums())
            self._begin_chunks()
        return self._chunk_sums

    def _begin_chunks(self) -> None:
        """Before the first chunk: the gradients zeroed (hook)."""
        self.optimizer.zero_grad(set_to_none=True)

    def _chunk_gradients(self, batch: Batch) -> torch.Tensor:
        """Backward of one chunk at normaliser 1 into the accumulated gradients; this rank's loss parts and
        log-prob sum (hook)."""
        return self._accumulate_local(batch, 1.0)

    def _step_chunks(self, scale: float) -> tuple[float, float | None]:
        """After the last chunk: the gradients scaled by ``scale`` (data-parallel size / the step's tokens),
        then the norm, the clip and the step (hook). Returns the norm and the learning rate (None: skipped)."""
        for p in self._parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        return self._apply_gradients()
