"""What one rank's megatron-core model is, from an HF ``config.json``: the layer spec (TransformerEngine's or
megatron's local one), megatron's ``TransformerConfig`` with its fused kernels and, for a mixture of experts,
its MoE fields.

Invariants: the architecture comes only from ``config.json`` (no per-size flags); a layout the model
cannot take (layers or heads not divisible by the parallel sizes, ``--sequence-parallel`` without TP and
TransformerEngine) is refused here, before anything is built. Works with megatron-core 0.16 (Python 3.11)
and 0.17+ (Python 3.12); TransformerEngine's spec is used when TE imports and CUDA is present, else the local
spec (with the CPU shims on a CPU host, :mod:`.cpu_shims`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlplacement.backends.megatron.cpu_shims import cuda_absent
from rlplacement.errors import ConfigError
from rlplacement.families import DenseFamily
from rlplacement.families import megatron_mapping as mapping

SPECS = ("auto", "local", "te")


def te_import_error() -> str | None:
    """Why TransformerEngine cannot be used here (None when it can): no CUDA, or its import error."""
    if cuda_absent():
        return "no CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # TE raises several kinds when its CUDA libraries are missing
        return f"{type(exc).__name__}: {exc}"
    return None


def te_available() -> bool:
    return te_import_error() is None


_WARNED: set[str] = set()


def resolve_spec(choice: str = "auto") -> str:
    """``local`` or ``te``; ``auto`` picks TE when it imports and CUDA is present.

    On a GPU host ``auto`` falling back to the local spec is a different model implementation
    (unfused kernels, other numerics and speed), so it is said once, with TE's import error.
    """
    if choice not in SPECS:
        raise ValueError(f"layer spec {choice!r} is unknown: use one of {', '.join(SPECS)}")
    why = te_import_error() if choice in ("auto", "te") else None
    if choice == "auto":
        if why is not None and why != "no CUDA device" and why not in _WARNED:
            _WARNED.add(why)
            warnings.warn(f"megatron layer spec 'auto' falls back to the local spec on a GPU host: "
                          f"TransformerEngine does not import ({why}); install it or choose the spec explicitly",
                          RuntimeWarning, stacklevel=2)
        return "te" if why is None else "local"
    if choice == "te" and why is not None:
        raise RuntimeError(f"layer spec 'te' needs transformer_engine and a CUDA device ({why}); use 'local'")
    return choice


def transformer_config(hf_config: Any, family: DenseFamily, tp: int, pp: int, dtype: torch.dtype,
                       spec: str = "local", on_gpu: bool | None = None, recompute: dict | None = None,
                       sequence_parallel: bool = False, attention_softmax_in_fp32: bool = True, moe=None):
    """megatron's ``TransformerConfig`` for this HF model and layout, with :func:`fusions` for ``spec`` on a
    GPU (``on_gpu``, default: where CUDA is). ``recompute``: ``recompute_granularity``, ``recompute_method``,
    ``recompute_num_layers`` (None entries left to megatron's defaults)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers {hf_config.num_hidden_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp}")
    recompute = {k: v for k, v in (recompute or {}).items() if v is not None}
    per_stage = hf_config.num_hidden_layers // pp
    if recompute.get("recompute_num_layers", 1) > per_stage:
        raise ConfigError(f"--recompute-num-layers {recompute['recompute_num_layers']} is more than a pipeline "
                          f"stage's {per_stage} layers ({hf_config.num_hidden_layers} over "
                          f"--pipeline-model-parallel-size {pp}): use {per_stage} or fewer.")
    if sequence_parallel and (tp == 1 or spec != "te"):
        why = ("--tensor-model-parallel-size is 1" if tp == 1 else
               f"the layer spec is {spec!r}, not TransformerEngine's ({te_import_error() or 'chosen explicitly'})")
        raise ConfigError(f"--sequence-parallel needs TP > 1 and the TransformerEngine layer spec, and {why}: "
                          f"drop --sequence-parallel, or run where TransformerEngine imports with TP > 1.")
    groups = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if groups % tp:
        raise ValueError(f"num_key_value_heads {groups} is not divisible by --tensor-model-parallel-size {tp}")
    cpu = cuda_absent() if on_gpu is None else not on_gpu
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=groups,
        kv_channels=mapping.ModelShape.from_hf(hf_config, 0).head_dim,
        ffn_hidden_size=hf_config.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=family.uses_qkv_bias(hf_config), qk_layernorm=family.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu, perform_initialization=False, sequence_parallel=sequence_parallel,
        attention_softmax_in_fp32=attention_softmax_in_fp32, **recompute,
    )
    if family.moe:
        kwargs.update(moe_settings(hf_config, family, tp, moe, ep=_expert_parallel_size()))
    return TransformerConfig(**kwargs, **fusions(spec, on_gpu=not cpu, wgrad_kernel=wgrad_kernel_available()))


def _expert_parallel_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def moe_settings(hf_config: Any, family, tp: int, moe=None, ep: int = 1) -> dict[str, Any]:
    """megatron's MoE fields for a :class:`~rlplacement.families.MoEFamily` model, from ``config.json``: the
    sparse layers as an explicit pattern (megatron's integer ``moe_layer_freq`` counts from layer 0, HF's
    ``decoder_sparse_step`` from layer 1), top-k routing over a softmax, renormalised over the chosen experts
    exactly when HF's ``norm_topk_prob`` is set (megatron's softmax after top-k; without it, softmax first),
    the sequential expert layout (the grouped ones need TransformerEngine or grouped_gemm), experts at the
    dense layers' TP, expert parallelism ``ep`` as the parallel groups have it (megatron's layers mark their
    experts' weights for DDP's expert-data-parallel reduction from this field, not from the groups: left at 1,
    DDP would sum different experts' gradients across ranks); and from ``moe``
    (:class:`~rlplacement.config.MoEConfig`, the flags) the load-balancing
    and z-loss weights, the token dispatcher, the router's dtype and whether its routers can replay rollout
    routes (``routing_replay``). megatron's load-balancing loss is its
    ``aux_loss`` (per micro-batch, scaled by megatron's schedule: the mean over a step's micro-batches)."""
    from rlplacement.config import MoEConfig
    from rlplacement.families import num_experts

    moe = moe or MoEConfig()
    aux = moe.aux_loss(hf_config)
    inter = hf_config.moe_intermediate_size
    if inter % tp:
        raise ValueError(f"moe_intermediate_size {inter} is not divisible by --tensor-model-parallel-size {tp}")
    return dict(num_moe_experts=num_experts(hf_config), moe_router_topk=hf_config.num_experts_per_tok,
                moe_ffn_hidden_size=inter, moe_layer_freq=[int(s) for s in family.sparse_layers(hf_config)],
                moe_router_score_function="softmax",
                moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
                moe_grouped_gemm=False, moe_token_dispatcher_type=moe.token_dispatcher_type, moe_aux_loss_coeff=aux,
                moe_router_load_balancing_type="aux_loss" if aux else "none", moe_z_loss_coeff=moe.z_loss_coeff,
                moe_router_dtype=moe.router_dtype, expert_model_parallel_size=ep, add_bias_linear=False,
                moe_enable_routing_replay=moe.rollout_routing_replay)


def fusions(spec: str, on_gpu: bool, wgrad_kernel: bool) -> dict[str, bool]:
    """The fused kernels to use: on a GPU, those megatron's training turns on by default (bias-SwiGLU and
    bias-dropout, torch-jitted, always; masked softmax and RoPE fusion with the TE spec, whose kernels they
    are; gradient-accumulation fusion with the TE spec where megatron's own linear layers, the output
    layer among them, find apex's ``fused_weight_gradient_mlp_cuda`` too (``wgrad_kernel``): they refuse
    the fusion without it, and megatron's training turns it off then); on a CPU none (CUDA-only)."""
    te = on_gpu and spec == "te"
    return dict(bias_activation_fusion=on_gpu, bias_dropout_fusion=on_gpu, masked_softmax_fusion=te,
                apply_rope_fusion=te, gradient_accumulation_fusion=te and wgrad_kernel, persist_layer_norm=False)


def wgrad_kernel_available() -> bool:
    """Whether megatron's linear layers found apex's fused weight-gradient kernel."""
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))


def layer_spec(family: DenseFamily, spec: str, config=None):
    """megatron's layer spec for ``family``; a mixture-of-experts family's is a block spec (dense and sparse
    layers per ``config.moe_layer_freq``, this pipeline stage's layers)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if family.moe:
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=spec == "te",
                                                          normalization="RMSNorm")
    if spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=family.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=family.qk_norm, normalization="RMSNorm")
