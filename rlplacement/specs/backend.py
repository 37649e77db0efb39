"""What a trainer backend is, for every layer that must know: one frozen :class:`BackendSpec` per backend,
registered where the backend is defined (:func:`register_backend`), and the registry of them by name.

The flags (``rlplacement.args``), the preflight, the transfer plan (``transfer.plan.for_layout``), the
pieces rule (``transfer.pieces``), the advisor's memory model and ``rlplacement plan`` read the spec and
never branch on a backend's name, so a new backend is one package that registers one spec (from outside
``rlplacement`` too, through the ``rlplacement.plugins`` entry points: :mod:`rlplacement.specs`).

The built-in specs (each in its backend's package: ``rlplacement.backends.megatron``, ``.fsdp``,
``.torchtitan``) are imported on the first lookup, then those of installed packages. The registry sits below
every layer that reads it (the transfer plan and the advisor too), so it names the backends' modules only as
strings. Every ``"module:name"`` field is
imported only when used: the spec itself is torch-free, so the flags and ``rlplacement plan`` read it
without torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplacement.specs import SpecRegistry, load_object

LAYERS, GRADIENT_CHECKPOINTING = "layers", "gradient checkpointing"
"""How a backend recomputes activations (:attr:`BackendSpec.recompute`): Megatron's per-layer flags
(``--recompute-granularity``, ``--recompute-method``, ``--recompute-num-layers``) or
``--gradient-checkpointing`` (every decoder layer)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """One trainer backend: its class, the flags it accepts, what the transfer plan and the advisor model
    of it, and its checks before any process starts."""

    name: str
    """The ``--train-backend`` value."""
    backend: str
    """``"module:Class"`` of its :class:`~rlplacement.backends.base.TrainerBackend` subclass (a classmethod
    ``from_config(cfg, optim, train=..., **options)`` builds it)."""
    summary: str
    """One line for the docs."""

    # --- the parallelism and feature flags it accepts (others are refused by name) ---
    model_parallel: bool = False
    """``--tensor-model-parallel-size``/``--pipeline-model-parallel-size`` above 1."""
    sequence_parallel: bool = False
    """``--sequence-parallel`` over its tensor-parallel ranks."""
    expert_parallel: bool = False
    """``--expert-model-parallel-size`` above 1."""
    distributed_optimizer: bool = False
    """``--use-distributed-optimizer`` (optimizer state sharded over the data-parallel ranks)."""
    fp32_switches: bool = False
    """``--no-accumulate-allreduce-grads-in-fp32`` and ``--no-attention-softmax-in-fp32`` (it has both
    switches; a backend without them reduces in fp32 and leaves the softmax to its attention kernel)."""
    recompute: str = GRADIENT_CHECKPOINTING
    """Its activation recompute: :data:`LAYERS` or :data:`GRADIENT_CHECKPOINTING`."""
    trains_moe: bool = False
    """Trains a mixture-of-experts model (the family's own blocks)."""
    moe_layer_flags: bool = False
    """``--moe-z-loss-coeff``, ``--moe-token-dispatcher-type`` and ``--moe-router-dtype`` configure its own
    MoE layer (a backend running the model's own MoE blocks has none)."""
    lora: bool = False
    """Trains LoRA adapters (``--lora-rank``)."""
    trains_during_rollout: bool = False
    """Its chunked step (``--train-during-rollout``: gradients of chunks accumulated, reduced and stepped once
    after the last) is checked against its whole-batch step; a backend without that check is refused."""
    lora_check: str | None = None
    """``"module:function"`` called as ``f(lora_config, sequence_parallel, moe=False)`` when the flags ask
    for LoRA: what its adapters do not cover, refused by flag (imported then: it may import torch)."""

    # --- the transfer ---
    sends_pieces: bool = False
    """A rank of a several-rank trainer where every rank sends may send the parts of the HF tensors it
    holds instead of gathering whole tensors (``transfer.pieces.trainer_sends_pieces``)."""
    holdings: str = ""
    """``"module:function"`` called as ``f(model, world=, tp=, pp=, ep=)``: what each trainer rank holds, as
    the transfer plan's boxes (``transfer.plan.trainer_shards``); a layout it cannot hold raises
    ``ValueError``."""
    piece_holdings: str | None = None
    """Same call: the pieces each rank sends (:attr:`sends_pieces`); None: what it holds, so the sharded
    plan is what runs where the engine's workers take slices."""
    share_holdings: str = ""
    """Same call: the whole tensors each rank sends when every rank sends its share of an update."""

    # --- the advisor ---
    memory: str = ""
    """``"module:function"`` called as ``f(model, world=, tp=, pp=, ep=, bf16=, distributed_optimizer=,
    lora=)``: the busiest rank's ``advisor.memory.RankMemory``."""

    # --- checks before any process starts (backends.preflight) ---
    load_config: str | None = None
    """``"module:function"`` called as ``f(load, tp)`` returning ``(hf_config, source)``: ``--load`` may be
    a folder of its own format that carries the model's ``config.json`` (so ``--hf-checkpoint`` is not
    needed), checked by this function; None: ``--load`` is one of its ``--save`` folders, and the model's
    config comes from the HF folder."""
    load_hint: str = ""
    """What else it starts from, for the refusal without an HF folder (" or --load (...)")."""
    preflight: str | None = None
    """``"module:function"`` called as ``f(cfg, hf_config, family, source, for_training=, cuda_available=)``
    after the shared checks: what this backend refuses of the model and the layout, from ``config.json``
    alone (torch-free but for ``cuda_available`` None, which it may ask torch)."""

    def backend_class(self) -> type:
        return load_object(self.backend)

    def call(self, field: str, *args: Any, **kwargs: Any) -> Any:
        """Call the ``"module:function"`` of ``field`` (None where the spec has none)."""
        path = getattr(self, field)
        return load_object(path)(*args, **kwargs) if path else None


BUILTIN_MODULES = ("rlplacement.backends.megatron", "rlplacement.backends.fsdp", "rlplacement.backends.torchtitan")

REGISTRY: SpecRegistry[BackendSpec] = SpecRegistry(
    "trainer backend", BUILTIN_MODULES,
    unknown=lambda name, known: f"--train-backend {name!r} is unknown: use one of {', '.join(known)}")


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Add ``spec`` (its package calls this where the spec is defined); a name taken already raises."""
    return REGISTRY.register(spec)


def unregister_backend(name: str) -> None:
    """Remove a backend (a plug-in's going away; a test's dummy backend after the test)."""
    REGISTRY.unregister(name)


def known_backends() -> list[str]:
    """The registered backends' names, sorted."""
    return sorted(REGISTRY.specs())


def backend_spec(name: str) -> BackendSpec:
    """The spec registered as ``name``; an unknown name raises ``ConfigError`` naming ``--train-backend``."""
    return REGISTRY.get(name)


def backends_with(feature: str) -> list[str]:
    """The registered backends whose spec has ``feature`` (a boolean field of :class:`BackendSpec`), sorted:
    what a refusal of that feature offers instead."""
    return sorted(name for name, s in REGISTRY.specs().items() if getattr(s, feature))


def spoken(names: list[str], word: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``: names as a message offers them."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def backend_class(name: str):
    """The backend class registered as ``name`` (imports its module)."""
    return backend_spec(name).backend_class()
