"""Rollout routing replay (``--use-rollout-routing-replay``): a forward over a :class:`Batch` with
``routed_experts`` routes each token of every sparse layer to the experts the engine routed it to.

The router still computes its scores; only the choice of experts is replayed, and each chosen expert is
weighted by the router's own score for it, normalised as the model normalises its top-k. On the tokens whose
routes equal the router's own top-k the forward is bit-identical to one without replay (the gathered scores
are the top-k's values): what replay changes is the tokens where trainer and engine would choose differently
(ties, and the numerical differences between two implementations of one model).

``routed_experts`` is ``[B, T, L, K]`` in vLLM's layout: position ``t``, each of the model's ``L`` layers
(``num_hidden_layers``, a dense layer's rows unread), the top ``K``. HF's routers see a micro-batch's tokens in
``(b, t)`` order; megatron's in ``(t, b)`` order, and under sequence parallelism each TP rank its slice of
``t``."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from rlplacement.errors import ConfigError


def check_routes(routes: torch.Tensor, hf_config: Any, sparse_layers: list[bool]) -> None:
    """``routes`` fits the model: one row per layer, top-k wide, each index an expert (raises naming what
    differs; reads the tensor's extrema once)."""
    from rlplacement.families import num_experts

    layers, k, experts = hf_config.num_hidden_layers, hf_config.num_experts_per_tok, num_experts(hf_config)
    if tuple(routes.shape[2:]) != (layers, k):
        raise ConfigError(f"Batch.routed_experts is [B, T, {routes.shape[2]}, {routes.shape[3]}]: this model has "
                          f"{layers} layers and routes to the top {k} experts, so it must be [B, T, {layers}, {k}] "
                          f"(build it with rlplacement.routed_experts_of from this job's rollout samples)")
    sparse = routes[:, :, torch.as_tensor(sparse_layers)]
    if sparse.numel() and not 0 <= int(sparse.min()) <= int(sparse.max()) < experts:
        raise ConfigError(f"Batch.routed_experts names experts {int(sparse.min())}..{int(sparse.max())}; this model's "
                          f"sparse layers have experts 0..{experts - 1}")


class HFRouteReplay:
    """Forward hooks on every router of transformers' Qwen3-MoE blocks in ``modules`` (the trained model and
    its frozen reference): while :meth:`routing` is open, each router's top-k indices and weights are the
    replayed ones. A hook, not a patched method: under activation checkpointing the recomputed forward runs
    it again with the same routes (the context spans the micro-batch's backward)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.routes: torch.Tensor | None = None
        self.handles = []
        for module in modules:
            for name, sub in module.named_modules():
                if type(sub).__name__.endswith("TopKRouter"):
                    layer = _layer_index(name)
                    self.handles.append(sub.register_forward_hook(self._hook(layer)))
        if not self.handles:
            raise ConfigError("--use-rollout-routing-replay: the model has no router this backend can replay "
                              "(transformers' *TopKRouter modules)")

    def _hook(self, layer: int):
        def replay(router: torch.nn.Module, args, output):
            if self.routes is None:
                return None
            logits = output[0]
            chosen = self.routes[:, :, layer].reshape(-1, self.routes.shape[-1]).to(logits.device, torch.int64)
            if chosen.shape[0] != logits.shape[0]:
                raise RuntimeError(f"routing replay: layer {layer}'s router saw {logits.shape[0]} tokens, the "
                                   f"routes hold {chosen.shape[0]}")
            probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
            weights = probs.gather(-1, chosen)
            if router.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return replay

    @contextlib.contextmanager
    def routing(self, routes: torch.Tensor | None) -> Iterator[None]:
        self.routes = routes
        try:
            yield
        finally:
            self.routes = None

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@contextlib.contextmanager
def hf_routed(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """``model``'s forwards replay ``routes`` while open (None: route as it would), its hooks removed after."""
    if routes is None:
        yield
        return
    replay = HFRouteReplay([model])
    try:
        with replay.routing(routes):
            yield
    finally:
        replay.close()


def _layer_index(module_name: str) -> int:
    parts = module_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise ConfigError(f"routing replay: cannot tell the layer of router {module_name!r}")


def megatron_routers(model: torch.nn.Module) -> list:
    """The routers of ``model`` (any wrapping) that megatron built with ``moe_enable_routing_replay``."""
    return [m for m in model.modules() if getattr(m, "router_replay", None) is not None]


def megatron_replay(model: torch.nn.Module, routes: torch.Tensor, *, tp_rank: int, tp_size: int,
                    sequence_parallel: bool) -> None:
    """Set every router of ``model`` to replay ``routes`` (``[B, T, L, K]``) on its next forwards: megatron's
    ``RouterReplay`` with ``REPLAY_FORWARD`` (each router gathers its scores at the given experts). Kept until
    :func:`megatron_clear`, so a recompute in the backward of the same micro-batch replays them too."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if sequence_parallel:
        per_rank = routes.shape[1] // tp_size
        routes = routes[:, tp_rank * per_rank:(tp_rank + 1) * per_rank]
    for router in megatron_routers(model):
        layer = router.layer_number - 1  # megatron numbers layers from 1, across pipeline stages
        chosen = routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]).to(torch.int64)
        replay = router.router_replay
        replay.clear_indices()
        replay.set_target_indices(chosen)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def megatron_clear(model: torch.nn.Module) -> None:
    """Every router of ``model`` back to its own top-k, its replayed indices dropped."""
    for router in megatron_routers(model):
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
