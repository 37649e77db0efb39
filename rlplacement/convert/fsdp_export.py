"""``rlplacement export-hf`` of a full-weight ``--save`` folder written by the fsdp backend: the trained model
as a Hugging Face folder.

That checkpoint (``torch.distributed.checkpoint``) holds the model's state dict under ``model.`` + the name
under the trained root, ``lm.`` + the HF model's own names; read without a process group, every tensor comes
back whole from all ranks' shards. The folder written holds exactly the tensors the ``--hf-config`` folder
holds (a tied output layer stays left out where it was), each in the dtype that folder publishes it in,
beside its config and tokenizer. It is written into ``OUT.tmp`` and renamed, so ``OUT`` is never half-written.

Other backends' full checkpoints name their tensors their own way (torchtitan's ``tok_embeddings``,
megatron's fused layers); megatron's are exported by :mod:`.megatron_to_hf`, the rest are refused by
:func:`hf_names` answering None.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from rlplacement.errors import ConfigError

PREFIX = "model.lm."
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def hf_folder_tensors(hf_dir: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """HF name -> (shape, safetensors dtype) of every tensor in ``hf_dir``'s safetensors files (headers only)."""
    from rlplacement.hf_folder import safetensors_headers

    return {k: (list(v["shape"]), v["dtype"]) for k, v in (safetensors_headers(hf_dir) or {}).items()}


def hf_names(folder: Path, hf_dir: str | os.PathLike) -> dict[str, str] | None:
    """Checkpoint key -> HF name for every tensor of ``hf_dir`` when the checkpoint ``folder`` (an ``iter_N``
    folder) holds each of them under :data:`PREFIX` with the same shape (an fsdp run's checkpoint of that
    model); None otherwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    wanted = hf_folder_tensors(hf_dir)
    keys = {name: PREFIX + name for name in wanted}
    fits = all(isinstance(metadata.get(key), TensorStorageMetadata) and list(metadata[key].size) == wanted[name][0]
               for name, key in keys.items())
    return {key: name for name, key in keys.items()} if wanted and fits else None


def export(folder: Path, out: str | os.PathLike, hf_dir: str | os.PathLike, max_shard_bytes: int) -> int:
    """Write the model of the checkpoint ``folder`` (see :func:`hf_names`, which must fit) to ``out`` as an HF
    folder with ``hf_dir``'s config and tokenizer; returns the tensors written."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rlplacement.atomic_files import fsync_dir
    from rlplacement.convert.hf_shards import ShardWriter
    from rlplacement.hf_folder import copy_side_files

    names = hf_names(folder, hf_dir)
    if names is None:
        raise ConfigError(f"--load {folder.parent}: its checkpoint does not hold --hf-config {hf_dir}'s tensors")
    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in names}
    with warnings.catch_warnings():  # no process group is the point here, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader, no_dist=True)
    dtypes = {name: dtype for name, (_, dtype) in hf_folder_tensors(hf_dir).items()}
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = ShardWriter(tmp, max_shard_bytes)
    for key, name in sorted(names.items(), key=lambda kv: kv[1]):
        dtype = SAFETENSORS_DTYPES.get(dtypes[name])
        writer.add(name, state.pop(key).to(getattr(torch, dtype)) if dtype else state.pop(key))
    written = writer.finish()
    copy_side_files(hf_dir, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return len(written)
