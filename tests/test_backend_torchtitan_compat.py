"""backends.torchtitan.compat: missing torch names are stood in for (and refuse use); other missing imports still fail."""

import sys

import pytest

from rlplacement.backends.torchtitan import compat


def _module(tmp_path, monkeypatch, name, body):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_missing_torch_names_and_modules_get_placeholders(tmp_path, monkeypatch):
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention as attention

    _module(tmp_path, monkeypatch, "needs_nightly_torch",
            "from torch.distributed.fsdp import fully_shard, RlplacementNightlyOnly\n"
            "from torch.nn.attention.rlplacement_nightly import AuxThing\n"
            "class Sub(AuxThing):\n    pass\n")
    try:
        added = compat.import_with_torch_placeholders("needs_nightly_torch")
        assert added == ["torch.distributed.fsdp.RlplacementNightlyOnly", "torch.nn.attention.rlplacement_nightly"]
        assert not hasattr(sys.modules["torch.nn.attention.rlplacement_nightly"], "__file__"), \
            "dunder lookups on a stand-in module stay absent (importers probe __file__, __path__)"
        assert fsdp.fully_shard.__module__.startswith("torch.distributed"), "existing names are left alone"
        with pytest.raises(RuntimeError, match=r"torch.distributed.fsdp.RlplacementNightlyOnly is missing from torch "
                                               r".*this torchtitan feature needs a newer torch"):
            fsdp.RlplacementNightlyOnly()
        with pytest.raises(RuntimeError, match=r"torch.nn.attention.rlplacement_nightly.AuxThing is missing"):
            sys.modules["needs_nightly_torch"].Sub()
    finally:
        monkeypatch.delattr(fsdp, "RlplacementNightlyOnly", raising=False)
        monkeypatch.delattr(attention, "rlplacement_nightly", raising=False)
        sys.modules.pop("torch.nn.attention.rlplacement_nightly", None)


def test_missing_non_torch_dependency_still_fails(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "needs_other", "import rlplacement_no_such_dependency\n")
    with pytest.raises(ModuleNotFoundError, match="rlplacement_no_such_dependency"):
        compat.import_with_torch_placeholders("needs_other")
    _module(tmp_path, monkeypatch, "needs_other_name", "from json import rlplacement_no_such_name\n")
    with pytest.raises(ImportError, match="cannot import name 'rlplacement_no_such_name' from 'json'"):
        compat.import_with_torch_placeholders("needs_other_name")
