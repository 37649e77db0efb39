"""HF folder -> Megatron torch_dist checkpoint (collective over the TP x PP ranks that build the model).

The model is built at the requested TP/PP from ``config.json``, each rank copies its shards from the
safetensors files, and ``dist_checkpointing`` saves global tensors, so the result loads at any TP/PP
whose size divides the padded vocabulary and the query groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from rlplacement.atomic_files import write_atomic
from rlplacement.families import megatron_mapping as mapping
from rlplacement.hf_folder import copy_side_files
from rlplacement.backends.megatron import model_build as mm
from rlplacement.families import family_for
from rlplacement.backends.megatron import checkpoint_layout as layout


def convert(hf_dir: str | os.PathLike, save_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
            spec: str = "auto", progress: bool = True, vocab_divisible_by: int = 128, ep: int = 1) -> str:
    """Convert; return ``"converted"`` or ``"skipped"`` (already finished). Every rank calls it (TP x PP x
    ``ep`` ranks: expert parallelism takes the data-parallel ranks, as in megatron)."""
    save = Path(save_dir)
    rank = dist.get_rank()
    decision = [None]
    if rank == 0:
        decision[0] = layout.state(save)
        if decision[0] == "partial":
            print(f"rlplacement convert: {save} holds a half-finished conversion (no {layout.MARKER}); redoing it",
                  flush=True)
            layout.clear_partial(save)
    dist.broadcast_object_list(decision, src=0)
    if decision[0] == "finished":
        if rank == 0:
            print(f"rlplacement convert: {save} is already converted ({layout.MARKER} present); nothing to do",
                  flush=True)
        return "skipped"

    hf_config = mm.load_hf_config(hf_dir)
    family = family_for(hf_config, f"{hf_dir}/config.json")
    padded = mapping.padded_vocab_size(hf_config.vocab_size, tp, vocab_divisible_by)
    shape = mapping.ModelShape.from_hf(hf_config, padded)
    mm.init_model_parallel(tp, pp, ep=ep)
    model = mm.build_model(hf_config, padded, tp, pp, spec)
    mm.load_hf_weights(model, hf_dir, shape, family, progress=progress and rank == 0)
    mm.save_torch_dist(model, save / layout.RELEASE)
    dist.barrier()
    if rank == 0:
        copy_side_files(hf_dir, save / layout.HF_CONFIG_DIR)
        meta = {**mm.model_meta(hf_config, family, padded, model.rlplacement_spec),
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                "megatron_core": _mcore_version(), "source": str(Path(hf_dir).resolve())}
        write_atomic(save / layout.META, json.dumps(meta, indent=2))
        write_atomic(save / layout.MARKER, "release")  # last: marks the folder complete
        print(f"rlplacement convert: wrote {save} (TP={tp}, PP={pp}{f', EP={ep}' if ep > 1 else ''}, "
              f"{model.rlplacement_spec} spec)", flush=True)
    dist.barrier()
    return "converted"


def _mcore_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")
