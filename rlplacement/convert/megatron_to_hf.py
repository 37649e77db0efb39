"""Megatron torch_dist checkpoint -> HF folder (collective; rank 0 writes).

Tensors stream out of :func:`~rlplacement.backends.megatron.update_streams.iter_hf_tensors` one parameter at a time and are written
in safetensors shards of at most ``max_shard_bytes`` (HF's index layout when there is more than one),
so exporting never holds the whole model on rank 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from rlplacement.families import megatron_mapping as mapping
from rlplacement.backends.megatron import model_build as mm
from rlplacement.backends.megatron.update_streams import iter_hf_tensors
from rlplacement.families import family_for
from rlplacement.convert.hf_shards import ShardWriter
from rlplacement.hf_folder import copy_side_files
from rlplacement.backends.megatron import checkpoint_layout as layout


def export(load_dir: str | os.PathLike, save_dir: str | os.PathLike, hf_config_dir: str | os.PathLike | None = None,
           tp: int = 1, pp: int = 1, spec: str = "auto", max_shard_bytes: int = 5 * 1024**3,
           progress: bool = False) -> list[str]:
    """Write an HF folder from a converted checkpoint; return the HF tensor names written (rank 0).
    ``progress``: a bar over the tensors written, on rank 0."""
    load = Path(load_dir)
    if layout.state(load) != "finished":
        raise FileNotFoundError(f"{load} has no {layout.MARKER}: not a finished torch_dist checkpoint; "
                                f"run `rlplacement convert` into it first")
    meta = json.loads((load / layout.META).read_text()) if (load / layout.META).is_file() else {}
    if not meta and hf_config_dir is None:
        raise FileNotFoundError(f"{load} was not written by rlplacement convert ({layout.META} missing): "
                                f"pass --hf-config with the model's HF folder")
    cfg_dir = Path(hf_config_dir) if hf_config_dir else load / layout.HF_CONFIG_DIR
    hf_config = mm.load_hf_config(cfg_dir)
    family = family_for(hf_config, f"{cfg_dir}/config.json")
    padded = meta.get("padded_vocab_size") or mapping.padded_vocab_size(hf_config.vocab_size, tp)
    shape = mapping.ModelShape.from_hf(hf_config, padded)
    mm.init_model_parallel(tp, pp)
    model = mm.build_model(hf_config, padded, tp, pp, spec)
    mm.load_torch_dist(model, layout.checkpoint_dir(load))
    writer = ShardWriter(Path(save_dir), max_shard_bytes) if dist.get_rank() == 0 else None
    # written in config.json's dtype: megatron may hold some tensors wider (its norms stay fp32 in a
    # bf16 model), and widening then narrowing back is exact
    dtype = mm.hf_dtype(hf_config)
    from tqdm import tqdm

    tensors = iter_hf_tensors(model, shape, family)
    for name, tensor in tqdm(tensors, desc="export", unit="tensor", disable=not (progress and writer is not None)):
        if writer is not None:
            writer.add(name, tensor.detach().cpu().to(dtype))
    if writer is None:
        return []
    names = writer.finish()
    copy_side_files(cfg_dir, save_dir)
    return names
