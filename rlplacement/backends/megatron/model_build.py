"""Building a megatron-core ``GPTModel`` from an HF config, filling it, and reading it back in HF names.

Used by ``rlplacement convert``/``export-hf`` and by the Megatron backend. Invariants:
- the architecture comes only from ``config.json`` (no per-size flags);
- loading and exporting are copies through :mod:`rlplacement.families.megatron_mapping`, so bytes survive;
- every function that talks to other ranks is collective: all ranks of the model-parallel world call
  it in the same order, and only global rank 0 yields or returns the full tensors.
Works with megatron-core 0.16 (Python 3.11) and 0.17+ (Python 3.12); the TransformerEngine layer spec
is used when TE imports and CUDA is present, else the local spec (with the CPU shims on a CPU host).
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplacement.errors import ConfigError
from rlplacement.families import megatron_mapping as mapping
from rlplacement.families import DenseFamily, family_for, rope_parameters
from rlplacement.backends.megatron.cpu_shims import apply_cpu_shims, cuda_absent, define_missing_te_names
from rlplacement.hf_folder import HFTensors
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

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


def init_model_parallel(tp: int, pp: int, seed: int = 1234, ep: int = 1) -> None:
    """Set up megatron's parallel groups on an initialised default process group (any backend); ``ep``:
    expert parallelism, carved out of the data-parallel ranks as megatron does (experts keep TP's size)."""
    apply_cpu_shims()
    define_missing_te_names()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) parallel sizes")
    if (world // (tp * pp)) % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {world // (tp * pp)} data-parallel ranks "
                         f"(world {world} over TP {tp} x PP {pp})")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def load_hf_config(hf_dir: str | os.PathLike):
    from transformers import AutoConfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found: pass a Hugging Face model folder")
    return AutoConfig.from_pretrained(str(path))


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


def build_model(hf_config: Any, padded_vocab: int, tp: int, pp: int, spec: str = "auto",
                dtype: torch.dtype | None = None, recompute: dict | None = None, sequence_parallel: bool = False,
                attention_softmax_in_fp32: bool = True, moe=None):
    """This rank's ``GPTModel`` stage, uninitialised (weights come from a load); ``recompute`` as
    :func:`transformer_config` takes it, ``moe`` (a mixture-of-experts model's flags) as :func:`moe_settings`."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    family = family_for(hf_config)
    if padded_vocab % tp:
        raise ValueError(f"padded vocabulary {padded_vocab} is not divisible by tensor parallel size {tp}")
    dtype = dtype or hf_dtype(hf_config)
    spec = resolve_spec(spec)
    rope = rope_parameters(hf_config)
    config = transformer_config(hf_config, family, tp, pp, dtype, spec, recompute=recompute,
                                sequence_parallel=sequence_parallel, attention_softmax_in_fp32=attention_softmax_in_fp32,
                                moe=moe)
    model = GPTModel(
        config, layer_spec(family, spec, config),
        vocab_size=padded_vocab, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=True),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_base=int(rope.get("rope_theta", 10000)),
    )
    if not cuda_absent():
        model = model.cuda(torch.cuda.current_device())
    mark_tensor_parallel(model)
    model.rlplacement_spec = spec
    return model


def mark_tensor_parallel(model) -> None:
    """Give every TP-split weight megatron's ``tensor_model_parallel``/``partition_dim``/``partition_stride``.

    megatron-core sets them only while it initialises the weights itself (``perform_initialization``),
    which a model filled from a checkpoint skips; without them megatron's gradient norm (clipping, the
    distributed optimizer) counts only TP rank 0's shard of every split weight. Set from the names
    (:func:`mapping.tp_partition_dim`), the same rule the stream and the loaders shard by."""
    for name, param in global_named_parameters(model):
        dim = mapping.tp_partition_dim(name)
        param.tensor_model_parallel = dim is not None
        param.partition_dim = -1 if dim is None else dim
        param.partition_stride = 1


def model_meta(hf_config: Any, family: DenseFamily, padded_vocab: int, spec: str) -> dict:
    """What a checkpoint folder records of the model beside its weights (``checkpoint_layout.META``)."""
    return {"family": family.name, "hf_vocab_size": hf_config.vocab_size, "padded_vocab_size": padded_vocab,
            "layer_spec": spec, "dtype": str(hf_dtype(hf_config)).removeprefix("torch.")}


def hf_dtype(hf_config: Any) -> torch.dtype:
    name = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name))


def global_named_parameters(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` with the global layer index in the name (a pipeline stage counts locally) and the
    global expert index (an expert-parallel rank counts its experts locally)."""
    layers = model.decoder.layers
    first_expert = 0
    experts = getattr(model.config, "num_moe_experts", None)
    if experts:
        from megatron.core import parallel_state as ps

        first_expert = ps.get_expert_model_parallel_rank() * (experts // ps.get_expert_model_parallel_world_size())
    for name, param in model.named_parameters():
        if ".lora." in name:  # LoRA adapters (backends.megatron.lora): not the model's own parameters
            continue
        layer, suffix = mapping._split_layer(name)
        if layer is not None:
            name = mapping.megatron_layer_name(layers[layer].layer_number - 1,
                                               mapping.global_expert_name(suffix, first_expert))
        yield name, param


def load_hf_weights(model, hf_dir: str | os.PathLike, shape: mapping.ModelShape, family: DenseFamily,
                    progress: bool = False) -> int:
    """Copy HF safetensors into this rank's shards (reads one tensor at a time); return tensors copied."""
    from megatron.core import parallel_state as ps
    from tqdm import tqdm

    read = HFTensors(hf_dir).get
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = list(global_named_parameters(model))
    bar = tqdm(params, desc="convert", unit="tensor", disable=not progress)
    with torch.no_grad():
        for mname, param in bar:
            full = mapping.hf_to_megatron(mname, read, shape, family)
            shard = mapping.tp_shard(mname, full, mapping.tp_partition_dim(mname), tp, rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{mname}: HF tensors give shard shape {tuple(shard.shape)}, model has "
                                 f"{tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
    return len(params)


GATHER_BUCKET_BYTES = 256 << 20
"""Bytes of one rank's shards gathered over TP in one collective (TP rank 0 holds TP x this at once)."""


class CollectiveCount:
    """Collectives this rank issued in its TP and PP groups during one weight stream."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int = 1) -> None:
        self.count += n


def _flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding ``tensors`` back to back (any dtypes)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _split_bytes(flat: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors :func:`_flat_bytes` packed, as views of ``flat`` (shapes and dtypes in order)."""
    out, offset = [], 0
    for shape, dtype in specs:
        n = _nbytes(shape, dtype)
        out.append(flat[offset:offset + n].view(dtype).view(shape))
        offset += n
    return out


def _buckets(meta: list[tuple], limit: int) -> list[list[tuple]]:
    """``meta`` rows cut into runs of at most ``limit`` local bytes (a larger tensor goes alone)."""
    buckets, current, size = [], [], 0
    for row in meta:
        n = _nbytes(row[1], row[2])
        if current and size + n > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(row)
        size += n
    return buckets + ([current] if current else [])


class _BucketGather:
    """One bucket's TP gather, started at once (``async_op``) and finished by :meth:`result`: the full
    tensors on TP rank ``dst`` of the stage's replica (None elsewhere), or on every TP rank where ``dst`` is
    None (an all-gather). Replicated tensors are taken from that rank's own parameters."""

    def __init__(self, bucket: list[tuple], params: dict[str, torch.Tensor], counter: CollectiveCount,
                 dst: int | None = 0):
        from megatron.core import parallel_state as ps

        self.bucket, self.params = bucket, params
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.first = dst is None or ps.get_tensor_model_parallel_rank() == dst
        self.split = [row for row in bucket if row[3] is not None and self.tp > 1]
        self.work, self.shards = None, None
        if self.split:
            group = ps.get_tensor_model_parallel_group()
            local = _flat_bytes([params[row[0]] for row in self.split])
            self.shards = [torch.empty_like(local) for _ in range(self.tp)] if self.first else None
            if dst is None:
                self.work = dist.all_gather(self.shards, local, group=group, async_op=True)
            else:
                self.work = dist.gather(local, self.shards, dst=dist.get_global_rank(group, dst), group=group,
                                        async_op=True)
            counter.add()

    def result(self) -> list[tuple[str, torch.Tensor]] | None:
        if self.work is not None:
            self.work.wait()
        if not self.first:
            return None
        gathered = {}
        if self.split:
            specs = [(row[1], row[2]) for row in self.split]
            per_rank = [_split_bytes(flat, specs) for flat in self.shards]
            for i, row in enumerate(self.split):
                gathered[row[0]] = mapping.tp_unshard(row[0], [r[i] for r in per_rank], row[3])
        return [(row[0], gathered.get(row[0], self.params[row[0]].detach())) for row in self.bucket]


def _gathered(work: list[tuple[list[tuple], int | None]], params: dict[str, torch.Tensor],
              counter: CollectiveCount) -> Iterator[list[tuple[str, torch.Tensor]] | None]:
    """Each ``(bucket, TP rank)`` of ``work`` gathered to that TP rank (every TP rank where None:
    :class:`_BucketGather`), in order: its full tensors there, None on the others. The next bucket's gather is started before the current
    one is handed on, so at most two buckets' full tensors are held."""
    pending = _BucketGather(work[0][0], params, counter, work[0][1]) if work else None
    for i in range(len(work)):
        current, pending = pending, (_BucketGather(work[i + 1][0], params, counter, work[i + 1][1])
                                     if i + 1 < len(work) else None)
        yield current.result()


def iter_full_megatron(model, bucket_bytes: int | None = None,
                       counter: CollectiveCount | None = None,
                       skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: yields ``(global megatron name, full tensor)`` on global rank 0, bucket by bucket.

    Per pipeline stage in order (under expert parallelism each expert-parallel rank's experts after the
    stage's other parameters, from that rank's first expert-data-parallel replica: :class:`ExpertRanks`):
    the stage's parameters are cut into buckets of ``bucket_bytes`` local
    bytes (default :data:`GATHER_BUCKET_BYTES`); the stage's TP ranks gather each bucket to their TP rank 0 in one collective, the next
    bucket's gather started before the current one is handed on; a stage whose first rank is not
    global rank 0 sends each whole bucket there in one message, received on rank 0's own device (a
    CPU buffer would fail under NCCL). ``counter`` counts this rank's collectives: on global rank 0,
    one per bucket and one per stage beyond the first (its table of names). Memory on global rank 0:
    two buckets' full tensors. ``skip``: megatron names left out (a tied output layer: nothing to send).
    """
    from megatron.core import parallel_state as ps

    counter = counter if counter is not None else CollectiveCount()
    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    device = next(model.parameters()).device
    experts = ExpertRanks.of(model, counter)
    for stage in range(pp):
        src = _stage_source_rank(stage)
        meta = [[(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]] \
            if stage == my_stage else [None]
        if pp > 1:
            dist.broadcast_object_list(meta, src=src, device=device if device.type == "cuda" else None)
            counter.add()
        rows = meta[0] if experts is None else [row for row in meta[0] if not is_expert(row[0])]
        yield from _to_rank0(src, rows, stage == my_stage and dp_rank == 0, params, device, counter, bucket_bytes)
        if experts is not None:  # each expert-parallel rank's experts of the stage, from that rank
            expert_rows = [row for row in meta[0] if is_expert(row[0])]
            for q in range(experts.size):
                yield from _to_rank0(experts.source(stage, q), experts.rows_of(q, expert_rows),
                                     stage == my_stage and experts.sends(q), params, device, counter, bucket_bytes)


def _to_rank0(src: int, rows: list[tuple], gathering: bool, params: dict[str, torch.Tensor], device,
              counter: CollectiveCount, bucket_bytes: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``rows`` (name, local shape, dtype, TP dim) in buckets to global rank 0: the TP ranks that hold them
    (``gathering``) gather each bucket to their TP rank 0, ``src``, which yields it if it is rank 0 or else
    sends it there in one message, received on rank 0's own device (a CPU buffer would fail under NCCL)."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    buckets = _buckets(rows, bucket_bytes or GATHER_BUCKET_BYTES)
    fulls = _gathered([(b, 0) for b in buckets], params, counter) if gathering else itertools.repeat(None)
    for bucket, full in zip(buckets, fulls):
        if src == 0:
            if rank == 0:
                yield from full
            continue
        if rank == src:
            dist.send(_flat_bytes([t for _, t in full]), dst=0)
            counter.add()
        elif rank == 0:
            specs = [(_full_shape(row, ps.get_tensor_model_parallel_world_size()), row[2]) for row in bucket]
            flat = torch.empty(sum(_nbytes(*spec) for spec in specs), dtype=torch.uint8, device=device)
            dist.recv(flat, src=src)
            counter.add()
            yield from zip([row[0] for row in bucket], _split_bytes(flat, specs))


def is_expert(name: str) -> bool:
    """Whether a (global) megatron parameter name is an expert's."""
    return mapping.expert_index(name) is not None


class ExpertRanks:
    """Where the experts live under expert parallelism (EP > 1): each expert-parallel rank q holds experts
    ``[q E/EP, (q+1) E/EP)`` of every sparse layer, replicated over the expert-data-parallel ranks; global
    names (:func:`global_named_parameters`) carry the global expert index. Learned once per model (its
    parallel groups do not change while it lives): every rank's (stage, TP rank, EP rank, expert-DP rank),
    one all-gather of small objects, counted in the first stream's collectives."""

    _of_model: "weakref.WeakKeyDictionary" = None  # model -> its ExpertRanks (see of)

    def __init__(self, model, counter: CollectiveCount):
        from megatron.core import parallel_state as ps

        self.size = ps.get_expert_model_parallel_world_size()
        self.local = model.config.num_moe_experts // self.size
        self.rank, self.data_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
        self.data_size = ps.get_expert_data_parallel_world_size()
        mine = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), self.rank, self.data_rank)
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, mine)
        counter.add()
        self._sources = {(c[0], c[2]): r for r, c in enumerate(coords) if c[1] == 0 and c[3] == 0}

    @classmethod
    def of(cls, model, counter: CollectiveCount) -> "ExpertRanks | None":
        """None without expert parallelism; else the model's, made at its first stream (collective then)."""
        import weakref

        from megatron.core import parallel_state as ps

        if not getattr(model.config, "num_moe_experts", None) or ps.get_expert_model_parallel_world_size() == 1:
            return None
        if cls._of_model is None:
            cls._of_model = weakref.WeakKeyDictionary()
        if model not in cls._of_model:
            cls._of_model[model] = cls(model, counter)
        return cls._of_model[model]

    def source(self, stage: int, q: int) -> int:
        """The global rank that sends stage ``stage``'s experts of expert-parallel rank ``q`` to rank 0."""
        return self._sources[(stage, q)]

    def sends(self, q: int) -> bool:
        """Whether this rank takes part in sending expert-parallel rank ``q``'s experts to rank 0."""
        return self.rank == q and self.data_rank == 0

    def rows_of(self, q: int, rows: list[tuple]) -> list[tuple]:
        """The rows of expert-parallel rank ``q``'s experts, from any rank's rows of its own (same shapes)."""
        return [(mapping.with_expert_index(row[0], mapping.expert_index(row[0]) % self.local + q * self.local), *row[1:])
                for row in rows]


def iter_own_stage_megatron(model, bucket_bytes: int | None = None,
                            counter: CollectiveCount | None = None,
                            skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective within each stage: every rank yields ``(global megatron name, full tensor)`` for the
    parameters of its own stage that it sends; nothing crosses a pipeline stage.

    Under expert parallelism each expert goes from a rank that holds it: the experts are shared out over
    their expert-data-parallel replicas' ``TP`` ranks, the other parameters as below.
    The stage's parameters are shared out over its ``DP x TP`` ranks whole, by full bytes
    (:func:`~rlplacement.transfer.plan.senders.spread_owners`: every rank computes the same answer from the
    same shapes). A DP replica's TP ranks then gather each of their replica's parameters to the TP rank
    that sends it, in buckets of at most ``bucket_bytes`` local bytes per owner, the next bucket's gather
    started before the current one is handed on. Replicas work on disjoint parameters at once, and so do
    stages. Memory on a sending rank: two buckets' full tensors, as on rank 0 in :func:`iter_full_megatron`.
    ``skip`` as there.
    """
    from megatron.core import parallel_state as ps

    from rlplacement.transfer.plan.senders import spread_owners

    counter = counter if counter is not None else CollectiveCount()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    rows = [(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]
    experts = ExpertRanks.of(model, counter)
    # (rows, the slots they are shared over, this replica's slot offset): experts under expert parallelism
    # go from the ranks that hold them, shared over their expert-data-parallel replicas
    groups = [(rows, dp * tp, dp_rank * tp)]
    if experts is not None:
        groups = [([r for r in rows if not is_expert(r[0])], dp * tp, dp_rank * tp),
                  ([r for r in rows if is_expert(r[0])], experts.data_size * tp, experts.data_rank * tp)]
    work = []  # (bucket, TP rank it is gathered to) of this replica, in order
    for group_rows, slots, first in groups:
        owners = spread_owners([_nbytes(_full_shape(row, tp), row[2]) for row in group_rows], slots)
        for dst in range(tp):
            mine = [row for row, owner in zip(group_rows, owners) if owner == first + dst]
            work.extend((bucket, dst) for bucket in _buckets(mine, bucket_bytes or GATHER_BUCKET_BYTES))
    for full in _gathered(work, params, counter):
        if full is not None:
            yield from full


def iter_own_pieces_megatron(model, shape: mapping.ModelShape, family: DenseFamily,
                             skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank yields the parts of the HF tensors its own shards are (``mapping.hf_pieces``) that it sends,
    each under its piece name (``transfer.pieces``; a whole tensor under its HF name): no collective at all,
    nothing gathered, nothing crossing a stage. A TP-split piece is held alike by every data-parallel
    replica of its TP rank and goes from one of them; a replicated tensor (norms) is held by every rank of
    the stage and goes from all of its ``DP x TP`` ranks. The holders of a piece split it by rows
    (``transfer.pieces.row_part``: ``torch.chunk``'s split, as FSDP2 shards), so every rank sends its share of
    every tensor it holds and a tensor's writes spread over all its holders, as the sharded plan's do. An
    expert's weights (under expert parallelism the rank's own experts, by their global index) are held alike
    by the expert-data-parallel replicas of its TP rank and split among them the same way.
    ``trainer_shards.megatron_piece_holdings`` is this rule for the simulator. ``skip`` as in
    :func:`iter_full_megatron`."""
    from megatron.core import parallel_state as ps

    from rlplacement.transfer.pieces import piece_name, row_part

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if getattr(model.config, "num_moe_experts", None):
        edp, edp_rank = ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()
    for mname, param in global_named_parameters(model):
        if mname in skip:
            continue
        if is_expert(mname):
            parts, mine = edp, edp_rank
        elif mapping.tp_partition_dim(mname) is None:
            parts, mine = dp * tp, dp_rank * tp + tp_rank
        else:
            parts, mine = dp, dp_rank
        for name, t, box, whole in mapping.hf_pieces(mname, param.detach(), shape, family, tp, tp_rank):
            rows = row_part(box, parts, mine)
            if rows is None:
                continue
            sub = ((box[0][0] + rows[0], box[0][0] + rows[1]),) + box[1:]
            part = t[rows[0]:rows[1]]
            yield (name if sub == tuple((0, n) for n in whole) else piece_name(name, sub, whole)), part


def iter_everywhere_megatron(model, bucket_bytes: int | None = None,
                             counter: CollectiveCount | None = None,
                             skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank yields every ``(global megatron name, full tensor)``, bucket by bucket: what a
    colocated engine worker reads from the trainer rank on its own GPU.

    Per pipeline stage in order, in buckets of ``bucket_bytes`` local bytes (default
    :data:`GATHER_BUCKET_BYTES`): the stage's TP ranks all-gather each bucket, every DP replica at once, the
    next bucket's gather started before the current one is handed on; with PP > 1 each of the stage's ranks
    then broadcasts the bucket's bytes in one message through its pipeline group, to the ranks of the same
    DP and TP position in the other stages. Under expert parallelism a stage's experts follow its other
    parameters: each bucket of a rank's own experts, gathered over TP, is all-gathered over the
    expert-parallel group (every rank then holds every expert of the bucket, named by its global index:
    :class:`ExpertRanks`), and with PP > 1 broadcast as above. ``counter`` counts this rank's collectives.
    Memory on every rank: two buckets' full tensors (an expert bucket ``EP`` times over), plus one received
    bucket with PP > 1. ``skip`` as in :func:`iter_full_megatron`.
    """
    from megatron.core import parallel_state as ps

    counter = counter if counter is not None else CollectiveCount()
    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    device = next(model.parameters()).device
    experts = ExpertRanks.of(model, counter)
    own = [(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]
    for stage in range(pp):
        meta = [own if stage == my_stage else None]
        if pp > 1:
            dist.broadcast_object_list(meta, src=_stage_source_rank(stage),
                                       device=device if device.type == "cuda" else None)
            counter.add()
        # this stage's rows: its own (the source's name another expert-parallel rank's experts), else received
        rows = own if stage == my_stage else meta[0]
        yield from _everywhere(stage, rows if experts is None else [r for r in rows if not is_expert(r[0])], params,
                               device, counter, bucket_bytes)
        if experts is not None:
            yield from _everywhere(stage, [r for r in rows if is_expert(r[0])], params, device, counter,
                                   bucket_bytes, experts)


def _everywhere(stage: int, rows: list[tuple], params: dict[str, torch.Tensor], device, counter: CollectiveCount,
                bucket_bytes: int | None, experts: "ExpertRanks | None" = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage ``stage``'s ``rows`` (name, local shape, dtype, TP dim) on every rank, bucket by bucket (see
    :func:`iter_everywhere_megatron`); ``experts``: the rows are this rank's own experts, all-gathered over the
    expert-parallel group into every expert-parallel rank's."""
    from megatron.core import parallel_state as ps

    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
    copies = 1 if experts is None else experts.size
    buckets = _buckets(rows, bucket_bytes or GATHER_BUCKET_BYTES)
    fulls = _gathered([(b, None) for b in buckets], params, counter) if stage == my_stage else itertools.repeat(None)
    for bucket, full in zip(buckets, fulls):
        specs = [(_full_shape(row, tp), row[2]) for row in bucket]
        if experts is None and pp == 1:
            yield from full
            continue
        size = sum(_nbytes(*spec) for spec in specs)
        own = _flat_bytes([t for _, t in full]) if stage == my_stage else None
        flat = own if experts is None and own is not None else torch.empty(copies * size, dtype=torch.uint8,
                                                                            device=device)
        if own is not None and experts is not None:
            dist.all_gather(list(flat.chunk(copies)), own, group=ps.get_expert_model_parallel_group())
            counter.add()
        if pp > 1:
            dist.broadcast(flat, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            counter.add()
        for q in range(copies):
            names = [row[0] for row in (bucket if experts is None else experts.rows_of(q, bucket))]
            yield from zip(names, _split_bytes(flat[q * size:(q + 1) * size], specs))


def _stage_source_rank(stage: int) -> int:
    """Global rank of (pipeline stage, TP rank 0, DP rank 0).

    megatron's default rank order "tp-cp-ep-dp-pp" makes the pipeline the outermost dimension, so a
    stage owns a contiguous block of ranks and the block's first rank is its TP/DP rank 0.
    """
    from megatron.core import parallel_state as ps

    return stage * (dist.get_world_size() // ps.get_pipeline_model_parallel_world_size())


def _full_shape(row: tuple, tp: int) -> tuple[int, ...]:
    """The whole tensor's shape from a stage's (name, local shape, dtype, partition dim) row."""
    name, shape, _, pdim = row
    if pdim is None:
        return shape
    full = list(shape)
    full[pdim] *= tp
    return tuple(full)


def iter_hf_tensors(model, shape: mapping.ModelShape, family: DenseFamily,
                    counter: CollectiveCount | None = None, *, share: str = RANK0) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: HF-named full tensors by ``share`` (who sends): on global rank 0 alone (nothing elsewhere,
    :func:`iter_full_megatron`), each on the rank of its stage that sends it (:data:`SHARES`,
    :func:`iter_own_stage_megatron`) or all on every rank (:data:`OWN_GPU`, :func:`iter_everywhere_megatron`);
    bucket by bucket. ``counter`` counts this rank's collectives. A tied output layer (the last stage's copy
    of the embedding at PP > 1) is neither gathered nor counted: it streams to no HF tensor."""
    streams = {RANK0: iter_full_megatron, SHARES: iter_own_stage_megatron, OWN_GPU: iter_everywhere_megatron}
    skip = frozenset({"output_layer.weight"}) if shape.tied else frozenset()
    for mname, full in streams[share](model, counter=counter, skip=skip):
        yield from mapping.megatron_to_hf(mname, full, shape, family)


def save_torch_dist(model, ckpt_dir: str | os.PathLike) -> None:
    """Collective: write this model with ``dist_checkpointing`` in Megatron's training layout."""
    from megatron.core import dist_checkpointing

    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
    dist_checkpointing.save(state, str(ckpt_dir))


def load_torch_dist(model, ckpt_dir: str | os.PathLike) -> None:
    """Collective: fill this rank's shards from a torch_dist checkpoint saved at any TP/PP."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt_dir))
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{ckpt_dir}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
