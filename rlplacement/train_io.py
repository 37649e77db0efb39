"""What a train call takes and gives back, between an RL loop, the job and every trainer rank.

:class:`Batch` goes in (tensors, never Python lists: a step of 512 x 4k tokens as nested lists costs
seconds to pickle and ~10x the bytes); :class:`TrainStepReport` comes back from each rank.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Batch:
    """A training batch, right-padded: the whole step's on the driver, one rank's share on a trainer rank.

    ``advantages`` is per sample (GRPO: the group-normalised reward)."""

    input_ids: torch.Tensor
    """``[B, T]`` int64 prompt + response token ids, right-padded."""
    loss_mask: torch.Tensor
    """``[B, T]`` 1 on the response tokens whose log-prob counts, 0 on prompt and padding."""
    advantages: torch.Tensor
    """``[B]`` one advantage per sample."""
    old_logprobs: torch.Tensor | None = None
    """``[B, T]`` the behaviour policy's log-probs (the engine's, at the positions of the tokens it sampled):
    given when samples may be stale (one-step-off), so the loss weighs them by a clipped importance ratio."""
    lengths: torch.Tensor | None = None
    """``[B]`` int64 tokens of each sample before its padding (prompt + response); None: all ``T``. Micro-batches
    are trimmed to their longest sample, so padding costs no compute."""
    routed_experts: torch.Tensor | None = None
    """``[B, T, L, K]`` integer: the experts position ``t`` was routed to in each of the model's ``L`` layers (top
    ``K``), as the engine routed it (:func:`routed_experts_of`; vLLM's layout: every layer, a dense layer's rows
    unread). Given (``--use-rollout-routing-replay``), every forward over the batch routes each token of a sparse
    layer to these experts; the router's own weights for them still weigh the experts' outputs."""
    rollout_logprobs: torch.Tensor | None = None
    """``[B, T]`` the engine's log-probs of the tokens it sampled (the behaviour policy, each token under the
    version that sampled it), for ``--use-tis``: ``old_logprobs`` are then the trainer's own at the step's
    start (the proximal policy PPO clips against), and each token's term is weighted by the truncated
    ``exp(old - rollout)``."""
    token_versions: torch.Tensor | None = None
    """``[B, T]`` integer: the weight version that sampled the token at each response position
    (:func:`token_versions_of`; prompt and padding positions hold -1). The job reads it under
    ``--mask-offpolicy-in-partial-rollout``: a token not sampled by the engines' current version leaves the
    loss (``RLJob.train``); the trainer ranks never receive it."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.dtype != torch.int64:
            raise ValueError(f"Batch.input_ids must be [B, T] int64, got {tuple(self.input_ids.shape)} "
                             f"{self.input_ids.dtype}")
        if tuple(self.loss_mask.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"Batch.loss_mask shape {tuple(self.loss_mask.shape)} must equal input_ids "
                             f"shape {tuple(self.input_ids.shape)}")
        if tuple(self.advantages.shape) != (self.input_ids.shape[0],):
            raise ValueError(f"Batch.advantages must be [B] = [{self.input_ids.shape[0]}], got "
                             f"{tuple(self.advantages.shape)}")
        for name in ("old_logprobs", "rollout_logprobs", "token_versions"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != tuple(self.input_ids.shape):
                raise ValueError(f"Batch.{name} shape {tuple(t.shape)} must equal input_ids "
                                 f"shape {tuple(self.input_ids.shape)}")
        if self.lengths is not None and tuple(self.lengths.shape) != (self.input_ids.shape[0],):
            raise ValueError(f"Batch.lengths must be [B] = [{self.input_ids.shape[0]}], got "
                             f"{tuple(self.lengths.shape)}")
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 4 or tuple(routed.shape[:2]) != tuple(self.input_ids.shape)
                                   or routed.is_floating_point()):
            raise ValueError(f"Batch.routed_experts must be [B, T, layers, top-k] integer with [B, T] = "
                             f"{list(self.input_ids.shape)}, got {tuple(routed.shape)} {routed.dtype}")

    def check_lengths(self) -> None:
        """Every length in ``1..T`` and no loss-mask token past it (reads the tensors: call it once, on the host)."""
        if self.lengths is None:
            return
        t = self.input_ids.shape[1]
        if len(self) and not 1 <= int(self.lengths.min()) <= int(self.lengths.max()) <= t:
            raise ValueError(f"Batch.lengths must lie in 1..{t} (the padded width), got {self.lengths.tolist()}")
        beyond = torch.arange(t)[None, :] >= self.lengths.cpu()[:, None]
        if bool((self.loss_mask.cpu().bool() & beyond).any()):
            raise ValueError("Batch.loss_mask counts a token past its sample's length (Batch.lengths)")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def sample_lengths(self) -> list[int]:
        return [self.input_ids.shape[1]] * len(self) if self.lengths is None else self.lengths.tolist()

    def rows(self, index: slice | list[int] | torch.Tensor) -> "Batch":
        """The samples at ``index`` (a slice gives views)."""
        return Batch(*(None if t is None else t[index] for t in self._fields()))

    def trimmed(self, multiple: int = 1) -> "Batch":
        """The same samples with the columns past the longest one dropped (views), the width rounded up to
        ``multiple`` (megatron's sequence parallelism splits it over TP ranks): columns added past the
        batch's own width are padding (token 0, outside the loss mask, log-prob 0)."""
        longest = max(self.sample_lengths(), default=0)
        width = -(-longest // multiple) * multiple
        have = self.input_ids.shape[1]
        if width in (0, have):
            return self
        if width < have:
            def cut(t):
                return None if t is None else t[:, :width]

            return Batch(cut(self.input_ids), cut(self.loss_mask), self.advantages, cut(self.old_logprobs),
                         self.lengths, cut(self.routed_experts), cut(self.rollout_logprobs),
                         cut(self.token_versions))

        def pad(t):
            return None if t is None else torch.nn.functional.pad(t, (0, width - have))

        return Batch(pad(self.input_ids), pad(self.loss_mask), self.advantages, pad(self.old_logprobs), self.lengths,
                     None if self.routed_experts is None else _pad_routes(self.routed_experts, width),
                     pad(self.rollout_logprobs),
                     None if self.token_versions is None else torch.nn.functional.pad(
                         self.token_versions, (0, width - have), value=-1))

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in self._fields()))

    def _fields(self) -> tuple:
        return (self.input_ids, self.loss_mask, self.advantages, self.old_logprobs, self.lengths, self.routed_experts,
                self.rollout_logprobs, self.token_versions)

    def only_version(self, version: int) -> "Batch":
        """The same batch with every loss-mask token not sampled by ``version`` taken out of the loss
        (``--mask-offpolicy-in-partial-rollout``); raises where :attr:`token_versions` is missing."""
        if self.token_versions is None:
            from rlplacement.errors import ConfigError

            raise ConfigError("the job masks off-policy tokens (--mask-offpolicy-in-partial-rollout) and the batch has "
                              "no token_versions: build it with rlplacement.token_versions_of(samples)")
        keep = (self.token_versions == version).to(self.loss_mask.dtype)
        return dataclasses.replace(self, loss_mask=self.loss_mask * keep)


def refuse_unreplayed_routes(batch: Batch, replays: bool) -> None:
    """Routes given to a job (or trainer) started without ``--use-rollout-routing-replay`` are refused by name."""
    if batch.routed_experts is not None and not replays:
        from rlplacement.errors import ConfigError

        raise ConfigError("Batch.routed_experts is given, and the job was started without "
                          "--use-rollout-routing-replay: start it with the flag, or leave routed_experts out")


def _pad_routes(routes: torch.Tensor, width: int) -> torch.Tensor:
    """``routes`` widened to ``width`` positions, each new one routed to experts ``0..K-1``: a padding position
    predicts nothing, and megatron's and HF's dispatch both need ``K`` distinct experts a token."""
    b, t, layers, k = routes.shape
    filler = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(b, width - t, layers, k)
    return torch.cat([routes, filler], dim=1)


def routed_experts_of(samples, width: int | None = None) -> torch.Tensor:
    """``[B, T, L, K]`` int32 :attr:`Batch.routed_experts` of rollout samples (``RolloutSample.routed_experts``,
    prompt and response positions), right-padded to ``width`` (default: the longest sample) the way
    :func:`_pad_routes` pads; raises naming the sample that has none (its engine returned none: start the job
    with ``--use-rollout-routing-replay``)."""
    missing = [i for i, s in enumerate(samples) if getattr(s, "routed_experts", None) is None]
    if missing:
        raise ValueError(f"rollout sample {missing[0]} has no routed_experts: its engine returns them only in a job "
                         f"started with --use-rollout-routing-replay")
    lengths = [len(s.routed_experts) for s in samples]
    width = max(lengths, default=0) if width is None else width
    rows = []
    for s, n in zip(samples, lengths):
        if n > width:
            raise ValueError(f"a sample's {n} routed positions exceed the batch width {width}")
        rows.append(_pad_routes(torch.as_tensor(s.routed_experts, dtype=torch.int32)[None], width))
    return torch.cat(rows)


def token_versions_of(samples, width: int | None = None) -> torch.Tensor:
    """``[B, T]`` int64 :attr:`Batch.token_versions` of rollout samples laid out as a batch is (prompt, then
    response, right-padded to ``width``, default the longest sample): each response token's version
    (``RolloutSample.versions``), -1 on prompt and padding positions."""
    lengths = [len(s.prompt_ids) + len(s.token_ids) for s in samples]
    width = max(lengths, default=0) if width is None else width
    out = torch.full((len(samples), width), -1, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        if n > width:
            raise ValueError(f"sample {i}'s {n} tokens exceed the batch width {width}")
        out[i, len(s.prompt_ids):n] = torch.as_tensor(s.versions, dtype=torch.int64)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStepReport:
    """One trainer rank's account of one train call (one or more optimizer steps). The loss and its parts
    are global token means over every data-parallel rank (the same on every rank), averaged over the
    call's optimizer steps."""

    rank: int
    """Global trainer rank."""
    loss: float
    """The objective: policy loss + KL term - entropy bonus."""
    grad_norm: float
    """Global L2 norm of the last step's gradient before clipping (the same on every rank)."""
    lr: float
    """Learning rate of the last optimizer step (0 if it was skipped)."""
    num_tokens: float
    """Response tokens in this rank's share (the loss mask's sum)."""
    mean_logprob: float
    """Mean log-prob of every rank's response tokens under the weights each step started from."""
    optimizer_steps: int = 1
    """Optimizer steps applied in this call."""
    skipped_steps: int = 0
    """Optimizer steps skipped so far in the run for a non-finite gradient norm (``train/skipped_steps``)."""
    kl: float = 0.0
    """The KL term's token mean (``--use-kl-loss``)."""
    entropy: float = 0.0
    """The policy's entropy, token mean (computed with ``--entropy-coef``)."""
    clip_fraction: float = 0.0
    """Fraction of response tokens whose importance ratio was clipped (stale samples only)."""
    start: float
    """Wall-clock time the call started on this rank (``time.time()``)."""
    end: float
    """Wall-clock time it ended; telemetry records the trainer's own busy time from these, not the driver's wait."""
