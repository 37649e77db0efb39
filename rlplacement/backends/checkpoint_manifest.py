"""A ``--save`` iteration's manifest (``checkpoint_manifest.json``): every file's size and xxh3-64, a digest
of the manifest itself, and the identity of the model trained (:func:`model_identity`). Read and checked
with JSON and raw bytes only, so a damaged file is named before anything in the folder is unpickled
(``checkpoint_files`` on the driver, ``train_checkpoint.verified`` in the trainer).

xxh3-64 and not sha256: the threat is corruption (a bad disk, a cut copy), which a 64-bit hash misses
with odds of about 2^-64 (sizes are compared too), at memory speed (so hashing is bound by the disk);
a cryptographic hash would not stop a writer of the folder, who could as well replace the pickles and
the manifest together.

Torch-free (preflight runs without torch); a leaf of the checkpoint modules.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, Iterable

from rlplacement.errors import ConfigError

log = logging.getLogger(__name__)

MANIFEST = "checkpoint_manifest.json"
HASH = "xxh3_64"
CHUNK_BYTES = 8 << 20
MANIFEST_FORMAT = 1
IDENTITY_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "tie_word_embeddings", "dtype")


# ---- checksums --------------------------------------------------------------------------------------
def file_digest(path: str | os.PathLike) -> str:
    """xxh3-64 of ``path``'s bytes, read in 8 MiB pieces into one reused buffer (memory stays flat)."""
    import xxhash

    digest = xxhash.xxh3_64()
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def digest_files(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "xxh3_64": digest}}`` of ``names`` under ``folder``."""
    return {name: {"bytes": (folder / name).stat().st_size, HASH: file_digest(folder / name)} for name in names}


def _body_digest(body: dict) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def manifest_text(files: dict[str, dict[str, Any]], model: dict[str, Any] | None) -> str:
    """The manifest of a checkpoint whose files are ``files`` (:func:`digest_files`), trained from ``model``."""
    body = {"format": MANIFEST_FORMAT, "hash": HASH, "files": files, "model": model or {}}
    return json.dumps({**body, "digest": _body_digest(body)}, indent=1, sort_keys=True)


def read_manifest(folder: str | os.PathLike, flag: str = "--load") -> dict[str, Any] | None:
    """``folder``'s manifest, checked against its own digest; None when it has none (a conversion, or an
    iteration saved before manifests were written: ``trainer_state.json`` says which)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        state = folder / "trainer_state.json"
        if state.is_file() and _json_or_none(state, {}).get("manifest"):
            raise ConfigError(f"{flag}: {path} is missing, though {state} says it was written: the checkpoint's "
                              f"files cannot be checked; restore the whole folder, or point --load at an earlier "
                              f"checkpoint (an earlier iter_N folder, named in latest_checkpointed_iteration.txt)")
        return None
    manifest = _json_or_none(path, None)
    if not isinstance(manifest, dict) or manifest.get("digest") != _body_digest(
            {k: v for k, v in manifest.items() if k != "digest"}):
        raise ConfigError(f"{flag}: {path} is damaged (it does not match its own digest): restore it from a copy, "
                          f"or point --load at an earlier checkpoint")
    return manifest


def _json_or_none(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def mismatches(folder: Path, manifest: dict[str, Any], names: Iterable[str] | None = None,
               flag: str = "--load") -> list[str]:
    """One sentence per file of ``names`` (default: all the manifest lists) that is missing, of another size,
    or of another digest than the manifest recorded; [] when all match."""
    fix = "restore it from a copy of the checkpoint, or point --load at an earlier checkpoint"
    out = []
    files = manifest["files"]
    for name in (sorted(files) if names is None else names):
        want, path = files[name], folder / name
        if not path.is_file():
            out.append(f"{flag}: {path} is missing (the checkpoint's manifest lists it): {fix}")
        elif path.stat().st_size != want["bytes"]:
            out.append(f"{flag}: {path} holds {path.stat().st_size} bytes, {want['bytes']} when it was saved: {fix}")
        elif (got := file_digest(path)) != want[HASH]:
            out.append(f"{flag}: {path} does not match the checksum recorded when it was saved (xxh3-64 "
                       f"{got}, recorded {want[HASH]}): the file is corrupted; {fix}")
    return out


def verify(folder: str | os.PathLike, flag: str = "--load") -> dict[str, Any] | None:
    """Refuse, naming the file, an iteration folder whose files differ from its manifest (all hashed
    here); returns the manifest, or None for a folder without one (a warning says it is unchecked)."""
    folder = Path(folder)
    manifest = read_manifest(folder, flag)
    if manifest is None:
        if (folder / "trainer_state.json").is_file():
            log.warning("%s %s: saved without checksums (an older --save); its files are not verified", flag, folder)
        return None
    bad = mismatches(folder, manifest, flag=flag)
    if bad:
        raise ConfigError(bad[0])
    return manifest


# ---- the model's identity ---------------------------------------------------------------------------
def model_identity(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """What makes a checkpoint fit a model, read from its HF folder without loading a weight: the config's
    :data:`IDENTITY_FIELDS` (a text model's inside a multimodal config) and, where the folder has
    safetensors, every weight's name and shape (from the files' JSON headers)."""
    folder = Path(hf_dir)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    config = {**text, **config}
    if "dtype" not in config and "torch_dtype" in config:
        config["dtype"] = config["torch_dtype"]
    out: dict[str, Any] = {k: config[k] for k in IDENTITY_FIELDS if k in config}
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        shapes.update(_safetensors_shapes(file))
    if shapes:
        out["parameters"] = dict(sorted(shapes.items()))
    return out


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    with open(file, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return {name: list(info["shape"]) for name, info in header.items() if name != "__metadata__"}


def check_identity(recorded: dict[str, Any], hf_dir: str | os.PathLike, what: str = "--load") -> None:
    """Refuse a checkpoint whose recorded identity differs from ``hf_dir``'s model, naming the first field
    (or weight) that differs and both values; fields only one side records are not compared (an identity
    from a conversion's config-only folder has no weights)."""
    if not recorded:
        return
    current = model_identity(hf_dir)
    fix = (f"pass the --hf-checkpoint the checkpoint was trained from, or drop --load to start fresh from "
           f"{hf_dir}")
    for field in IDENTITY_FIELDS:
        if field in recorded and field in current and recorded[field] != current[field]:
            raise ConfigError(f"{what}: the checkpoint was saved from another model: {field} is {recorded[field]!r} "
                              f"in the checkpoint, {current[field]!r} in --hf-checkpoint {hf_dir}; {fix}")
    saved, here = recorded.get("parameters"), current.get("parameters")
    if saved and here and saved != here:
        name = next(n for n in sorted(set(saved) | set(here)) if saved.get(n) != here.get(n))
        raise ConfigError(f"{what}: the checkpoint was saved from another model: weight {name} has shape "
                          f"{saved.get(name, 'absent')} in the checkpoint, {here.get(name, 'absent')} in "
                          f"--hf-checkpoint {hf_dir}; {fix}")
