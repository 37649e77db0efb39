"""What each trainer rank holds of every HF tensor, as boxes: Megatron's TP x PP x DP layout, FSDP2's
dim-0 shards, and the rank-0 layout today's senders use (rank 0 gathers everything).

``Holdings`` is indexed by global rank; a tensor a rank does not hold is absent from its dict. Ranks
that hold the same box (data-parallel replicas, TP ranks of a replicated norm) are the candidates the
plan chooses one sender from.
"""

from __future__ import annotations

from rlplacement.transfer.plan.boxes import Box, along, volume, whole
from rlplacement.transfer.plan.tensors import ModelTensors

Holdings = list[dict[str, Box]]


def megatron_padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_megatron(model: ModelTensors, tp: int, pp: int) -> None:
    """Refuse a TP/PP Megatron cannot build for this model, naming the flag."""
    for what, n in (("num_attention_heads", model.num_heads), ("num_key_value_heads", model.num_kv_heads),
                    ("intermediate_size", model.ffn_hidden_size)):
        if n % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {what}={n} of {model.source}: "
                             f"use a divisor of it")
    if model.num_layers % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide num_hidden_layers="
                         f"{model.num_layers} of {model.source}: use a divisor of it")


def expert_of(name: str) -> int | None:
    """The expert index of an HF expert tensor's name (``...mlp.experts.{j}.``), None for any other."""
    if ".mlp.experts." not in name:
        return None
    return int(name.split(".mlp.experts.")[1].split(".")[0])


def has_experts(model: ModelTensors) -> bool:
    """Whether the model has mixture-of-experts tensors (``transfer.pieces.trainer_sends_pieces``' ``moe``)."""
    return any(expert_of(t.name) is not None for t in model.tensors)


def experts_per_rank(model: ModelTensors, ep: int) -> int:
    """Experts each of ``ep`` expert-parallel ranks holds (raises naming the flag where ``ep`` does not divide
    them)."""
    experts = 1 + max((expert_of(t.name) or 0) for t in model.tensors)
    if experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {experts} experts of {model.source}")
    return experts // ep


def megatron_holdings(model: ModelTensors, tp: int, pp: int, dp: int, ep: int = 1) -> Holdings:
    """Global rank ``t + tp * (d + dp * p)`` (megatron's default order, TP fastest, then DP, then PP)
    holds its TP slice of stage ``p``'s tensors; data-parallel replicas hold the same (the distributed
    optimizer shards optimizer state, not the bf16 parameters). Under expert parallelism (carved out of DP:
    DP rank ``d`` is expert-parallel rank ``d % ep``) a rank holds the experts of its expert-parallel rank
    only. A vocabulary shard wholly in Megatron's padding holds nothing."""
    check_megatron(model, tp, pp)
    if dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {dp} data-parallel ranks")
    local = experts_per_rank(model, ep) if ep > 1 else 0
    padded = megatron_padded_vocab(model.vocab_size, tp)
    out: Holdings = [{} for _ in range(tp * pp * dp)]
    for t in model.tensors:
        p = model.stage_of(t, pp)
        expert = expert_of(t.name) if ep > 1 else None
        for r in range(tp):
            box = model.tp_box(t, r, tp, padded)
            if volume(box):
                for d in range(dp):
                    if expert is None or d % ep == expert // local:
                        out[r + tp * (d + dp * p)][t.name] = box
    return out


def fsdp_holdings(model: ModelTensors, world: int) -> Holdings:
    """FSDP2's ``Shard(0)``: rank ``r`` holds rows ``[r*c, (r+1)*c)`` of every tensor, ``c = ceil(rows /
    world)`` (``torch.chunk``'s split; trailing ranks of a short tensor hold nothing); a sparse layer's experts,
    which transformers fuses into one parameter of an expert per row, by expert: each expert's tensors whole on
    the rank holding its row."""
    from rlplacement.transfer.pieces import row_part

    out: Holdings = [{} for _ in range(world)]
    experts = 1 + max((expert_of(t.name) or 0) for t in model.tensors) if has_experts(model) else 0
    holder = {}  # a sparse layer's fused experts are sharded by expert: each expert's tensors whole on one rank
    for r in range(world):
        part = row_part(((0, experts),), world, r) if experts else None
        if part is not None:
            holder.update((e, r) for e in range(*part))
    for t in model.tensors:
        e = expert_of(t.name)
        if e is not None:
            out[holder[e]][t.name] = whole(t.shape)
            continue
        for r in range(world):
            rows = row_part(whole(t.shape), world, r)
            if rows is not None:
                out[r][t.name] = along(t.shape, 0, *rows)
    return out


def rank0_holdings(model: ModelTensors, world: int) -> Holdings:
    """Today's senders: rank 0 has gathered every tensor whole, and only rank 0 sends."""
    return [{t.name: whole(t.shape) for t in model.tensors}] + [{} for _ in range(world - 1)]


def everywhere_holdings(model: ModelTensors, ranks, world: int) -> Holdings:
    """Every tensor whole on each of ``ranks`` (each gathered the whole model, ``iter_update_tensors(OWN_GPU)``:
    the colocated ranks that hand their GPU's engine worker the update), nothing on the others."""
    everything = {t.name: whole(t.shape) for t in model.tensors}
    ranks = set(ranks)
    return [dict(everything) if r in ranks else {} for r in range(world)]


def share_holdings(model: ModelTensors, world: int) -> Holdings:
    """What each rank of an FSDP or torchtitan trainer sends when every rank sends its share: exactly the
    tensors ``TrainerBackend.update_owners`` gives it (whole, a fused parameter's pieces together, largest
    first), so the plan's bytes per sender are the run's. (Which of two equal-sized tensors a rank gets may
    differ, since the model's parameter order is not this list's; the bytes per rank do not.)"""
    from rlplacement.transfer.bucket import fused_group_of
    from rlplacement.transfer.plan.senders import spread_owners_by_group

    owners = spread_owners_by_group([(t.name, t.bytes(model.itemsize)) for t in model.tensors], world,
                                    fused_group_of)
    out: Holdings = [{} for _ in range(world)]
    for t in model.tensors:
        out[owners[t.name]][t.name] = whole(t.shape)
    return out


def megatron_share_holdings(model: ModelTensors, tp: int, pp: int, dp: int, ep: int = 1) -> Holdings:
    """What each rank of a Megatron trainer sends when every rank sends its share
    (``update_streams.iter_own_stage_megatron``): each stage's parameters (an HF fused group is one megatron
    parameter: q/k/v, gate/up) shared out whole over the stage's ``DP x TP`` ranks by their full bytes,
    vocabulary padded as Megatron pads it, largest first; the rank sends the parameter's HF tensors. Under
    expert parallelism the experts are left out of that and each expert-parallel rank's experts are shared out
    the same way over the ``DP / EP x TP`` ranks that hold them. The same rule on the same sizes as the
    runtime, so the bytes per rank are the run's."""
    from rlplacement.transfer.bucket import fused_group_of
    from rlplacement.transfer.plan.senders import spread_owners

    check_megatron(model, tp, pp)
    local = experts_per_rank(model, ep) if ep > 1 else 0
    padded = megatron_padded_vocab(model.vocab_size, tp)
    out: Holdings = [{} for _ in range(tp * pp * dp)]

    def share(tensors: list, slots: list[int]) -> None:
        """``tensors``' fused groups spread over the global ranks ``slots``, in order."""
        groups: dict[str, list] = {}
        for t in tensors:
            groups.setdefault(fused_group_of(t.name), []).append(t)
        sizes = [sum((padded * t.shape[1] if t.kind == "vocab" else volume(whole(t.shape))) for t in group)
                 * model.itemsize for group in groups.values()]
        for group, owner in zip(groups.values(), spread_owners(sizes, len(slots))):
            for t in group:
                out[slots[owner]][t.name] = whole(t.shape)

    for stage in range(pp):
        tensors = [t for t in model.tensors if model.stage_of(t, pp) == stage]
        first = stage * dp * tp
        share([t for t in tensors if ep == 1 or expert_of(t.name) is None], [first + s for s in range(dp * tp)])
        for q in range(ep if ep > 1 else 0):  # EP rank q's experts, over DP ranks q, q + ep, ... and their TP
            slots = [first + (q + ep * e) * tp + t for e in range(dp // ep) for t in range(tp)]
            share([t for t in tensors if expert_of(t.name) is not None and expert_of(t.name) // local == q], slots)
    return out


def megatron_piece_holdings(model: ModelTensors, tp: int, pp: int, dp: int, ep: int = 1) -> Holdings:
    """What each rank of a Megatron trainer sends when it sends pieces (``update_streams.iter_own_pieces_megatron``):
    every box a rank holds (:func:`megatron_holdings`: its TP rank's box of each TP-split tensor of its stage, a
    replicated tensor whole, under expert parallelism its own experts), split by rows among the ranks that hold
    that same box, in rank order (``transfer.pieces.row_part``): a TP-split tensor among its data-parallel
    replicas, a replicated one among the stage's ``DP x TP`` ranks, an expert's among its expert-data-parallel
    replicas. The runtime's rule, so the bytes per rank are the run's."""
    from rlplacement.transfer.pieces import row_part

    held = megatron_holdings(model, tp, pp, dp, ep)
    holders: dict[tuple[str, Box], list[int]] = {}
    for rank, boxes in enumerate(held):
        for name, box in boxes.items():
            holders.setdefault((name, box), []).append(rank)
    out: Holdings = [{} for _ in held]
    for (name, box), ranks in holders.items():
        for index, rank in enumerate(ranks):
            rows = row_part(box, len(ranks), index)
            if rows is not None:
                out[rank][name] = ((box[0][0] + rows[0], box[0][0] + rows[1]),) + box[1:]
    return out
