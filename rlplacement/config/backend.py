"""Which trainer backend trains, from which weights, with which model parallelism; its mixture-of-experts
and LoRA settings."""

from __future__ import annotations

import dataclasses


MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = ("fp32", "fp64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts model's training settings (Miles' flags). The architecture comes from
    ``config.json``; ``num_experts``, ``router_topk`` and ``ffn_hidden_size`` are what the flags declared (None:
    not given), checked against it and refused by name where they differ."""

    num_experts: int | None = None
    """``--num-experts``: experts per sparse layer, as ``config.json``'s ``num_experts``."""
    router_topk: int | None = None
    """``--moe-router-topk``: experts per token, as ``num_experts_per_tok``."""
    ffn_hidden_size: int | None = None
    """``--moe-ffn-hidden-size``: each expert's intermediate size, as ``moe_intermediate_size``."""
    aux_loss_coeff: float | None = None
    """``--moe-aux-loss-coeff``: the routers' load-balancing loss weight. None: ``config.json``'s
    ``router_aux_loss_coef`` where its ``output_router_logits`` is on, else 0 (off)."""
    z_loss_coeff: float | None = None
    """``--moe-z-loss-coeff``: the router z-loss weight (megatron), None: off."""
    token_dispatcher_type: str = "allgather"
    """``--moe-token-dispatcher-type``: megatron's token dispatcher (``allgather`` or ``alltoall``)."""
    router_dtype: str | None = None
    """``--moe-router-dtype``: megatron computes the router in fp32 or fp64 (None: the model's dtype)."""
    rollout_routing_replay: bool = False
    """``--use-rollout-routing-replay``: the engines return the experts each token was routed to (vLLM's
    ``enable_return_routed_experts``), :attr:`RolloutSample.routed_experts` carries them, and the trainer routes
    every token of a :class:`Batch` with ``routed_experts`` to those experts instead of its own top-k (its router
    still weighs them), so training and rollout run the same experts."""

    def aux_loss(self, hf_config) -> float:
        """The load-balancing loss weight this run trains with (see :attr:`aux_loss_coeff`)."""
        if self.aux_loss_coeff is not None:
            return self.aux_loss_coeff
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(
            hf_config, "output_router_logits", False) else 0.0


MOE_FLAGS = {"num_experts": "--num-experts", "router_topk": "--moe-router-topk",
             "ffn_hidden_size": "--moe-ffn-hidden-size", "aux_loss_coeff": "--moe-aux-loss-coeff",
             "z_loss_coeff": "--moe-z-loss-coeff", "token_dispatcher_type": "--moe-token-dispatcher-type",
             "router_dtype": "--moe-router-dtype", "rollout_routing_replay": "--use-rollout-routing-replay"}
"""Each :class:`MoEConfig` field's flag (Miles' name)."""


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers an adapter can sit on, in HF's names (``all-linear``: every one)."""
LORA_MEGATRON_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                       "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""``--target-modules`` in megatron's names, as the HF layers they fuse."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters (Miles' flags): rank-``rank`` adapters on ``target_modules`` with the base frozen.
    ``rank`` 0: no adapters (full fine-tuning)."""

    rank: int = 0
    """``--lora-rank``: each adapter's rank (0: off)."""
    alpha: float = 16.0
    """``--lora-alpha``: the adapter's output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """``--lora-dropout``: dropout on each adapter's input while training."""
    target_modules: tuple[str, ...] = LORA_MODULES
    """``--target-modules``: HF layer names (``--target-modules all-linear``: every decoder linear layer)."""
    adapter_path: str | None = None
    """``--lora-adapter-path``: a PEFT adapter folder the adapters start from (None: ``A`` drawn, ``B`` zero)."""
    merge_for_rollout: bool = False
    """``--lora-merge-for-rollout``: the trainer merges the adapters into the base and every update sends the
    merged weights whole (the slow path: a full model's bytes per update). Off: every update sends only the
    adapters, which the engines serve live on the checkpoint's base (:attr:`adapter_updates`)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def adapter_updates(self) -> bool:
        """Updates carry the adapters alone, into a live vLLM adapter over the engines' frozen base."""
        return self.enabled and not self.merge_for_rollout

    def live_spec(self) -> dict:
        """What an engine needs to serve the adapters live (``VllmRolloutEngine(live_lora=)``)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which trainer backend trains, from which weights, with which model parallelism."""

    name: str = "megatron"
    """A registered trainer backend (``rlplacement.backends.registry``): megatron, fsdp, torchtitan, ..."""
    hf_checkpoint: str | None = None
    """Hugging Face model folder: the architecture, the tokenizer, and the weights unless ``load`` is set."""
    load: str | None = None
    """A training checkpoint in the backend's format to start from (``--load``): Megatron's ``torch_dist``
    folder (``rlplacement convert``'s output is iteration 0, model only), or a ``--save`` folder."""
    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size; the trainer's GPUs are a multiple of TP x PP."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline-parallel size."""
    context_parallel_size: int = 1
    """Megatron context parallelism (``--context-parallel-size``): only 1 is built; a larger size is refused."""
    expert_model_parallel_size: int = 1
    """Megatron expert parallelism (``--expert-model-parallel-size``) of a mixture-of-experts model: any size
    that divides the experts and the data-parallel ranks; colocated, each rank all-gathers the other ranks'
    experts for the worker on its GPU."""
    expert_tensor_parallel_size: int | None = None
    """Megatron's TP inside experts (``--expert-tensor-parallel-size``): None or 1 (experts at the dense TP)."""
    moe: MoEConfig = MoEConfig()
    """A mixture-of-experts model's settings (for a dense model, those megatron itself leaves unset are refused,
    the rest ignored, as megatron does)."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (``--lora-rank`` and its kin); off by default."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the activations outside attention and MLP split along the sequence over
    the TP ranks (needs TP > 1 and the TransformerEngine layer spec); micro-batches are padded to a multiple
    of TP tokens. Validated here; not exercised on the hardware this project has (one GPU, no TP)."""
