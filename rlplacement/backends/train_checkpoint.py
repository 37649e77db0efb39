"""A training checkpoint (``--save``, read back with ``--load``): the FSDP-sharded backends write it with
``torch.distributed.checkpoint``, megatron with its ``dist_checkpointing`` (on the same storage format,
through :func:`publish` and :func:`restore`); every rank writes its own shards, and a later run may have
another number of ranks.

```
SAVE/iter_0000012/.metadata, __*_*.distcp   the model and optimizer state dicts (DCP)
SAVE/iter_0000012/trainer_state.json        train calls, optimizer steps, skipped steps, weight version
SAVE/iter_0000012/rng_rank{R}.pt            each rank's RNG states
SAVE/iter_0000012/checkpoint_manifest.json  every file's size and xxh3-64, the model's identity
SAVE/latest_checkpointed_iteration.txt      "12", written last
```
``trainer_state.json`` also carries ``job_state``: the driver's own small state (``RLJob``'s generate
calls, epoch, run id, the caller's sampler position), returned in ``resumed["job_state"]``.

Invariant: a checkpoint is published only whole. Every rank writes into ``iter_N.tmp``; after all of
them finished, the ranks hash its files (each a share), rank 0 writes the manifest, renames the folder
to ``iter_N`` and then replaces the marker atomically. A folder whose marker is missing, or names an
iteration folder without its metadata or state, is refused by name; at load every file is checked
against the manifest (each rank a share) before anything in it is unpickled (``checkpoint_manifest``).

Torch-free at import (preflight checks ``--load`` folders without torch).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from rlplacement.atomic_files import fsync_dir, write_atomic
from rlplacement.backends import checkpoint_manifest
from rlplacement.errors import ConfigError

MARKER = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"
DCP_METADATA = ".metadata"


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest(root: str | os.PathLike, flag: str = "--load") -> Path:
    """The last published iteration folder of ``root``; ConfigError naming what is missing otherwise."""
    root = Path(root)
    marker = root / MARKER
    if not marker.is_file():
        raise ConfigError(f"{flag} {root}: no {MARKER}, so it holds no finished training checkpoint: pass a "
                          f"folder written by --save (or drop {flag} to start from --hf-checkpoint)")
    text = marker.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{flag} {root}: {MARKER} says {text!r}, not an iteration: this is not a --save folder "
                          f"of this backend")
    folder = iteration_dir(root, int(text))
    for name in (DCP_METADATA, STATE):
        if not (folder / name).is_file():
            raise ConfigError(f"{flag} {root}: {folder / name} is missing, so iteration {text} was cut short: "
                              f"restore the folder, or point {MARKER} at an earlier complete iteration")
    return folder


def read_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / STATE).read_text())


def _options(trainable_only: bool):
    """``torch.distributed.checkpoint``'s state-dict options: ``trainable_only`` leaves frozen parameters out
    (LoRA's base, which the run's model folder holds, checked by its identity)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def save(root: str | os.PathLike, iteration: int, model, optimizer, state: dict[str, Any],
         identity: dict[str, Any] | None = None, trainable_only: bool = False) -> Path:
    """Collective: write ``model``'s and ``optimizer``'s sharded state (``torch.distributed.checkpoint``), this
    rank's RNG and (rank 0) ``state`` into ``iter_N.tmp``, then publish it with the model's ``identity``
    (``checkpoint_manifest.model_identity``). Returns the published folder. ``trainable_only``: frozen
    parameters left out (:func:`_options`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def write(tmp: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))

    return publish(root, iteration, write, state, identity)


def publish(root: str | os.PathLike, iteration: int, write: Callable[[Path], None], state: dict[str, Any],
            identity: dict[str, Any] | None = None) -> Path:
    """Collective: ``write(tmp)`` on every rank (its shards, in the backend's format), this rank's RNG and
    (rank 0) ``state`` into ``iter_N.tmp``; once every rank is done, the ranks hash its files and rank 0
    writes the manifest (with ``identity``), renames the folder ``iter_N`` and then points the marker at
    it. Returns the published folder."""
    import torch
    import torch.distributed as dist

    final = iteration_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a run killed while saving left
        tmp.mkdir(parents=True)
    dist.barrier()
    write(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        write_atomic(tmp / STATE, json.dumps({**state, "manifest": True}, indent=2))
    dist.barrier()  # every rank's shards are in place
    digests = _gathered(checkpoint_manifest.digest_files(tmp, _share(checkpoint_manifest.files_of(tmp))))
    if rank == 0:
        files = {name: d for part in digests for name, d in part.items()}
        write_atomic(tmp / checkpoint_manifest.MANIFEST, checkpoint_manifest.manifest_text(files, identity))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        write_atomic(Path(root) / MARKER, str(iteration))  # last: the checkpoint is whole
    dist.barrier()
    return final


def load(folder: Path, model, optimizer, hf_dir: str | os.PathLike | None = None,
         trainable_only: bool = False) -> dict[str, Any]:
    """Collective: model and optimizer state from ``folder`` (any number of ranks wrote it, checked first:
    :func:`restore`), this rank's RNG when the same rank wrote one; returns the saved state.
    ``trainable_only``: frozen parameters keep the values they were built with (:func:`_options`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _options(trainable_only)

    def read(folder: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                       options=options)

    return restore(folder, read, hf_dir)


def restore(folder: Path, read: Callable[[Path], None], hf_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Collective: check ``folder`` (:func:`verified`), then ``read(folder)`` on every rank (its shards), then
    this rank's RNG when the same rank wrote one; returns the saved state, its ``job_state`` ({} when it
    recorded none) and ``model`` (the identity it recorded, {} if none) included."""
    import torch
    import torch.distributed as dist

    manifest = verified(folder, hf_dir)
    read(folder)
    rng_file = folder / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    state = read_state(folder)
    return {**state, "job_state": state.get("job_state") or {}, "model": (manifest or {}).get("model") or {}}


def verified(folder: Path, hf_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Collective, before anything in ``folder`` is unpickled: its recorded model matches ``hf_dir``'s
    (when given) and every file matches its manifest (each rank hashes a share; every rank raises the
    same ConfigError, naming the first bad file). Returns the manifest (None: an older checkpoint
    without one, loaded unchecked with a warning)."""
    import torch.distributed as dist

    flag = f"--load {folder.parent}"
    manifest = checkpoint_manifest.read_manifest(folder, flag)
    if manifest is None:
        if dist.get_rank() == 0:
            checkpoint_manifest.verify(folder, flag)  # the warning
        return None
    if hf_dir:
        checkpoint_manifest.check_identity(manifest.get("model") or {}, hf_dir, flag)
    bad = _gathered(checkpoint_manifest.mismatches(folder, manifest, _share(sorted(manifest["files"])), flag))
    problems = sorted(p for part in bad for p in part)
    if problems:
        raise ConfigError(problems[0])
    return manifest


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (round robin: every rank hashes about as many files)."""
    import torch.distributed as dist

    return names[dist.get_rank()::dist.get_world_size()]


def _gathered(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (small JSON-like values: file digests, error sentences), in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
