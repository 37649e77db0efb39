"""`convert` and `export-hf` refuse, naming the flag, the folders they would spoil: a --save that holds the
user's own files (a rerun clears only a conversion cut short), --save equal to --hf-checkpoint, an export
onto the folder it reads; and export-hf's hint never suggests converting into the folder given as --load."""

import subprocess
import sys

import pytest

from rlplacement.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "model")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlplacement.cli", *argv], capture_output=True, text=True,
                          timeout=300)


def test_convert_into_a_folder_of_other_files_is_refused_and_leaves_them_alone(tiny, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    out = _cli("convert", "--hf-checkpoint", str(tiny), "--save", str(mine), "--no-progress")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"--save {mine} is not empty and not a conversion (it holds notes.txt): pass a new or empty folder" \
        in out.stderr
    assert "Traceback" not in out.stderr and "half-finished" not in out.stdout
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_convert_into_the_hf_folder_is_refused(tiny):
    before = sorted(p.name for p in tiny.iterdir())
    out = _cli("convert", "--hf-checkpoint", str(tiny), "--save", str(tiny), "--no-progress")
    assert out.returncode == 2 and f"--save {tiny} is --hf-checkpoint's folder" in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tiny.iterdir()) == before


def test_export_hf_from_an_hf_folder_says_so_and_never_hints_converting_into_it(tiny, tmp_path):
    out = _cli("export-hf", "--load", str(tiny), "--save", str(tmp_path / "out"))
    assert out.returncode == 2 and f"--load {tiny} is a Hugging Face folder already" in out.stderr, out.stderr
    assert f"--save {tiny}" not in out.stderr and "Traceback" not in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _cli("export-hf", "--load", str(empty), "--save", str(tmp_path / "out"))
    assert out.returncode == 2 and f"--load {empty}: no latest_checkpointed_iteration.txt there" in out.stderr
    assert f"--save {empty}`" not in out.stderr and "--save NEW_DIR" in out.stderr


def test_export_hf_onto_the_folder_it_reads_is_refused(tiny, tmp_path):
    out = _cli("export-hf", "--load", str(tmp_path), "--save", str(tmp_path))
    assert out.returncode == 2 and f"--save {tmp_path} is --load's folder" in out.stderr, out.stderr
    out = _cli("export-hf", "--load", str(tmp_path), "--save", str(tiny), "--hf-config", str(tiny))
    assert out.returncode == 2 and f"--save {tiny} is --hf-config's folder" in out.stderr, out.stderr
    assert (tiny / "config.json").is_file()
