"""What a vLLM engine serves, built from the trainer's HF tensors: the reference a peer's update is checked
against, parameter by parameter, where only the engine's own names can be read back.

vLLM (tensor parallel 1, unquantized, Qwen3 and Qwen3-MoE) fuses some HF tensors into one parameter:

* ``self_attn.{q,k,v}_proj.weight`` -> ``self_attn.qkv_proj.weight``, rows in that order;
* ``mlp.{gate,up}_proj.weight`` -> ``mlp.gate_up_proj.weight``, gate rows first;
* ``mlp.experts.{e}.{gate,up}_proj.weight`` -> ``mlp.experts.w13_weight`` ``[E, 2I, H]``, per expert gate rows
  then up rows (FusedMoE's w1 then w3), experts in index order;
* ``mlp.experts.{e}.down_proj.weight`` -> ``mlp.experts.w2_weight`` ``[E, H, I]``.

vLLM 0.26 registers those two under ``mlp.experts.routed_experts.`` (its MoE layer holds the routed experts
in a submodule): :func:`compare` reads a served name through :func:`canonical` first. Seen on the first GPU
run (2026-12-07, H100): without it the four layers' eight expert parameters were reported missing and
unexpected, so the peers' check covered the 31 other parameters only.

Every other tensor is served under its own name. The rule holds only where vLLM keeps the loaded layout
(no re-layout after loading), which is what the colocated runs here use; a checker built on it reports a
served parameter it cannot match rather than passing it, and a trainer tensor no served parameter covers.
"""

from __future__ import annotations

import re

_FUSED = ((re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.weight$"), "qkv_proj.weight", ("q", "k", "v")),
          (re.compile(r"^(.*\.mlp\.)(gate|up)_proj\.weight$"), "gate_up_proj.weight", ("gate", "up")))
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def served_groups(names) -> dict[str, tuple[str, list]]:
    """Served name -> (kind, members) for the HF ``names``: kind ``same`` (one name), ``cat`` (names
    concatenated along rows, in fusion order), ``w13`` (per expert, in index order, its [gate, up] names)
    or ``w2`` (per expert, its down name). A fused group missing a member is left out: nothing served
    equals an incomplete concatenation, and the checker then reports the member as uncovered."""
    groups: dict[str, tuple[str, list]] = {}
    parts: dict[str, dict] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = name
            continue
        for pattern, fused, order in _FUSED:
            m = pattern.match(name)
            if m:
                parts.setdefault(m.group(1) + fused, {"order": order})[m.group(2)] = name
                break
        else:
            groups[name] = ("same", [name])
    for served, found in parts.items():
        if all(p in found for p in found["order"]):
            groups[served] = ("cat", [found[p] for p in found["order"]])
    for prefix, by_index in experts.items():
        ordered = [by_index[e] for e in sorted(by_index)]
        if sorted(by_index) == list(range(len(by_index))) and all({"gate", "up", "down"} <= set(e) for e in ordered):
            groups[prefix + "w13_weight"] = ("w13", [[e["gate"], e["up"]] for e in ordered])
            groups[prefix + "w2_weight"] = ("w2", [e["down"] for e in ordered])
    return groups


def build(kind: str, members: list, tensors: dict):
    """The served tensor of one group, from the HF ``tensors`` (a fresh tensor unless ``same``)."""
    import torch

    if kind == "same":
        return tensors[members[0]]
    if kind == "cat":
        return torch.cat([tensors[n] for n in members], dim=0)
    if kind == "w13":
        return torch.stack([torch.cat([tensors[g], tensors[u]], dim=0) for g, u in members])
    if kind == "w2":
        return torch.stack([tensors[n] for n in members])
    raise ValueError(f"unknown group kind {kind!r}")


def covered(groups: dict[str, tuple[str, list]]) -> set[str]:
    """The HF names some served group takes."""
    out: set[str] = set()
    for kind, members in groups.values():
        for m in members:
            out.update(m if isinstance(m, list) else [m])
    return out


_ROUTED = re.compile(r"\.experts\.routed_experts\.(w13_weight|w2_weight)$")


def canonical(served_name: str) -> str:
    """The served name as :func:`served_groups` names it (vLLM 0.26's ``experts.routed_experts.w13_weight``
    -> ``experts.w13_weight``)."""
    return _ROUTED.sub(r".experts.\1", served_name)


def compare(expected: dict[str, str], served: dict[str, str], hf_names) -> dict:
    """The check of one update: every expected served checksum present and equal, every HF tensor covered.
    ``served`` parameters with no expectation (none in these shapes) are listed, never counted as checked."""
    served = {canonical(n): c for n, c in served.items()}
    missing = sorted(n for n in expected if n not in served)
    differing = sorted(n for n in expected if n in served and served[n] != expected[n])
    uncovered = sorted(set(hf_names) - covered(served_groups(hf_names)))
    return {"bit_exact": not (missing or differing or uncovered), "checked": len(expected) - len(missing),
            "differing": differing[:20], "missing": missing[:20], "uncovered": uncovered[:20],
            "unexpected": sorted(n for n in served if n not in expected)[:20]}
