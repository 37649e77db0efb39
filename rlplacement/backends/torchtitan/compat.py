"""Importing torchtitan 0.3.0 on an older torch (the GPU machine has torch 2.11) by standing in for
torch names it imports at module level but our path never uses.

torchtitan tracks torch nightly: 0.3.0 imports, at module level, symbols that torch 2.11 lacks
(``torch.distributed.fsdp.DataParallelMeshDims`` is known to be nightly-only; others may follow).
The backend uses only long-standing torch APIs (FSDP2 ``fully_shard``, DTensor, SDPA), so a missing
``torch`` name is replaced by a placeholder class that raises if anything ever instantiates or calls
it. Invariants: only names under ``torch`` are stood in for (a missing triton, spmd_types, tyro still
fails the import, with its own message); nothing is replaced that exists; every stand-in is recorded
in :data:`PLACEHOLDERS` so runs report which torchtitan features would be unavailable.
"""

from __future__ import annotations

import importlib
import re
import sys
import types

PLACEHOLDERS: list[str] = []
_CANNOT_IMPORT = re.compile(r"cannot import name '([^']+)' from '([^']+)'")
_MAX_STAND_INS = 50


def _placeholder(qualname: str) -> type:
    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"{qualname} is missing from torch {_torch_version()}; rlplacement stood in a "
                           f"placeholder so torchtitan imports, and this torchtitan feature needs a newer torch")

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": refuse, "__call__": refuse,
                                                   "__module__": qualname.rsplit(".", 1)[0],
                                                   "_rlplacement_placeholder": True})


def _torch_version() -> str:
    import torch

    return torch.__version__


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def stand_in(attr: str):
        if attr.startswith("__"):  # __file__, __path__, __spec__ ...: absent, as for any plain module
            raise AttributeError(attr)
        return _placeholder(f"{name}.{attr}")

    module.__getattr__ = stand_in  # type: ignore[method-assign]
    module._rlplacement_placeholder = True
    return module


def _stand_in(exc: ImportError) -> str | None:
    """Install a stand-in for what ``exc`` says is missing under torch; return its name, or None."""
    match = _CANNOT_IMPORT.search(str(exc))
    if match:
        attr, module_name = match.groups()
        if module_name != "torch" and not module_name.startswith("torch."):
            return None
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        if hasattr(module, attr):
            return None  # present: the failure is something else (e.g. a circular import)
        setattr(module, attr, _placeholder(f"{module_name}.{attr}"))
        return f"{module_name}.{attr}"
    missing = getattr(exc, "name", None)
    if isinstance(exc, ModuleNotFoundError) and missing and missing.startswith("torch."):
        parent_name, _, child = missing.rpartition(".")
        parent = importlib.import_module(parent_name)
        module = _placeholder_module(missing)
        sys.modules[missing] = module
        setattr(parent, child, module)
        return missing
    return None


def import_with_torch_placeholders(*module_names: str) -> list[str]:
    """Import ``module_names``, standing in for missing torch names; return the names stood in for.

    Raises the original ImportError when what is missing is not under ``torch``.
    """
    added: list[str] = []
    for name in module_names:
        while True:
            try:
                importlib.import_module(name)
                break
            except ImportError as exc:
                stood_in = _stand_in(exc)
                if stood_in is None or stood_in in added or len(added) >= _MAX_STAND_INS:
                    raise
                added.append(stood_in)
                PLACEHOLDERS.append(stood_in)
    return added


def import_torchtitan_models() -> list[str]:
    """Import torchtitan's Qwen3 and Llama3 models (see the module docstring); return the stand-ins."""
    return import_with_torch_placeholders("torchtitan.models.qwen3.model", "torchtitan.models.llama3.model",
                                          "torchtitan.models.common.config_utils")
