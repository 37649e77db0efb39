"""This rank's megatron-core ``GPTModel`` stage: parallel groups set up, the stage built from an HF config
(:mod:`.model_config`), filled from HF safetensors or a torch_dist checkpoint, and written as one.

Used by ``rlplacement convert``/``export-hf`` and by the Megatron backend. Invariants:
- loading is a copy through :mod:`rlplacement.families.megatron_mapping`, so bytes survive;
- parameters carry global names (:func:`global_named_parameters`): the global layer index and, under
  expert parallelism, the global expert index, which the loaders, the update streams and checkpoints share;
- the torch_dist functions are collective: every rank of the model-parallel world calls them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplacement.backends.megatron.cpu_shims import apply_cpu_shims, cuda_absent, define_missing_te_names
from rlplacement.backends.megatron.model_config import layer_spec, resolve_spec, transformer_config
from rlplacement.families import DenseFamily, family_for, rope_parameters
from rlplacement.families import megatron_mapping as mapping
from rlplacement.hf_folder import HFTensors


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
