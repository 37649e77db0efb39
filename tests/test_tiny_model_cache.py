"""The tiny models' cache: a kept folder is byte for byte what a fresh make writes, a caller's edit of its
copy never reaches the cache, and a later make of the same spec reads the cache without transformers."""

import subprocess
import sys

from rlplacement.models.tiny import CACHE_ENV, TinySpec, make_tiny_model


def _files(folder):
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_a_kept_folder_is_what_a_fresh_make_writes(tmp_path, monkeypatch):
    spec = TinySpec(family="qwen3_moe", seed=7)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    made = make_tiny_model(tmp_path / "made", spec)  # made and kept
    (kept,) = (tmp_path / "cache").iterdir()
    copied = make_tiny_model(tmp_path / "copied", spec)
    (copied / "config.json").write_text("{}")  # the caller's copy, not the cache
    again = make_tiny_model(tmp_path / "again", spec)
    monkeypatch.setenv(CACHE_ENV, "0")
    fresh = make_tiny_model(tmp_path / "fresh", spec)
    assert _files(made) == _files(kept) == _files(again) == _files(fresh)
    assert len(_files(fresh)) >= 5 and "model.safetensors" in _files(fresh)
    assert _files(copied)["config.json"] == b"{}"
    assert list((tmp_path / "cache").iterdir()) == [kept]  # one folder per spec, no leftovers of making
    other = make_tiny_model(tmp_path / "other", TinySpec(family="qwen3_moe", seed=8))
    assert _files(other)["model.safetensors"] != _files(fresh)["model.safetensors"]


def test_a_kept_spec_is_made_without_importing_transformers(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    made = make_tiny_model(tmp_path / "made")  # here, with transformers
    code = ("import sys; from rlplacement.models.tiny import make_tiny_model as m; m(sys.argv[1]); "
            "print(sorted(k for k in ('transformers', 'torch') if k in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "copied")], env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert _files(made) == _files(tmp_path / "copied")
