"""The plans of a layout, from the validated flags and a model's config: the sharded plan (every rank sends
what it holds, every worker receives its slice), the spread plan (what split layouts of ``broadcast``,
``broadcast_packed`` and ``p2p`` run: an FSDP rank sends its own rows of every tensor, a megatron or torchtitan
rank its share of whole tensors it gathered, each worker receiving its slices of them; colocated ``cuda_ipc``:
every rank hands the whole model to the worker on its own GPU) and the
rank-0 plan (rank 0 sends every worker every tensor whole: the baseline, and what runs for a one-rank
trainer, with slices where the mode sends them); each simulated on the layout's GPUs.
"""

from __future__ import annotations

import dataclasses

from rlplacement.specs.engine import DEFAULT_ENGINE_KIND
from rlplacement.transfer.pieces import trainer_sends_pieces
from rlplacement.transfer.plan.boxes import intersect, volume
from rlplacement.transfer.plan.build import BROADCAST, WRITE, TransferPlan, build_plan, build_write_plan
from rlplacement.transfer.plan.engine_shards import whole_model_needs
from rlplacement.transfer.plan.simulate import RPC_S, RPC_S_COLOCATED, LinkRates, Simulation, simulate
from rlplacement.transfer.plan.tensors import ModelTensors
from rlplacement.transfer.plan.trainer_shards import everywhere_holdings, rank0_holdings
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES


@dataclasses.dataclass(frozen=True)
class PlanPair:
    """The plans of one layout: ``sharded`` (each worker receives its slice: planned), ``spread`` (several
    trainer ranks send whole tensors, as ``who`` says: each its share, what split layouts of the spreading
    modes run, or each the whole model to the worker on its GPU, what ``cuda_ipc`` runs colocated; None
    where rank 0 sends alone) and ``rank0`` (rank 0 sends everything). ``runs``: the key of the one that
    runs."""

    sharded: TransferPlan
    sharded_sim: Simulation
    rank0: TransferPlan
    rank0_sim: Simulation
    spread: TransferPlan | None = None
    spread_sim: Simulation | None = None
    who: str = RANK0
    """Who sends in the plan that runs (``ModeSpec.who_sends``; :data:`RANK0` for a one-rank trainer)."""

    @property
    def runs(self) -> str:
        return "rank0" if self.who == RANK0 else "spread"

    def to_json(self) -> dict:
        plans = [("sharded", self.sharded, self.sharded_sim), ("rank0", self.rank0, self.rank0_sim)]
        if self.spread is not None:
            plans.append(("spread", self.spread, self.spread_sim))
        return {"runs": self.runs, "who_sends": self.who,
                **{name: {**plan.summary(), **sim.to_json()} for name, plan, sim in plans}}


def _split_plan(model: ModelTensors, holdings: list[dict], worker_needs: list[dict], engines: int,
                fanout: str) -> TransferPlan:
    """The plan of a split layout of ``engines`` alike engines (worker ``w`` keeping ``worker_needs[w]``):
    p2p's writes through :func:`build_write_plan` (built once for every engine where no sender choice
    depends on the engine)."""
    if fanout == WRITE:
        return build_write_plan(model, holdings, worker_needs, engines)
    return build_plan(model, holdings, {(e, w): need for e in range(engines) for w, need in enumerate(worker_needs)},
                      fanout)


def trainer_holdings(model: ModelTensors, backend: str, world: int, tp: int = 1, pp: int = 1, ep: int = 1):
    """What each trainer rank holds, as ``backend``'s spec says (``BackendSpec.holdings``: Megatron's
    TP x PP x DP, under EP each rank its experts; FSDP2's dim-0 shards for fsdp and torchtitan)."""
    from rlplacement.specs.backend import backend_spec

    return backend_spec(backend).call("holdings", model, world=world, tp=tp, pp=pp, ep=ep)


def _missing_bytes(model: ModelTensors, held: dict, wanted: dict) -> int:
    """Bytes of ``wanted`` boxes outside the ``held`` ones (both keyed by tensor name)."""
    out = 0
    for name, box in wanted.items():
        have = held.get(name)
        part = intersect(box, have) if have else None
        out += volume(box) - (volume(part) if part else 0)
    return out * model.itemsize


def plans_for(model: ModelTensors, layout, *, backend: str, tp: int, pp: int, mode: str,
              assumptions, ep: int = 1, slices: str = "auto", engine_kind: str = DEFAULT_ENGINE_KIND) -> PlanPair:
    """Both plans of ``layout`` (a :class:`~rlplacement.placement.layout.Layout`) for ``mode`` (a
    transfer mode's name; ``cuda_ipc`` colocated), simulated at ``assumptions``' rates (the advisor's
    :class:`~rlplacement.advisor.thresholds.ModelAssumptions`) times the mode's measured or estimated share
    of each link (:meth:`LinkRates.for_mode`).

    Sharded, split: each worker's slice comes from the ranks that hold it. Sharded, colocated: each
    trainer rank first gathers what the worker on its GPU keeps and the worker reads it there, so no
    engine reads another GPU's trainer memory. Rank 0: rank 0 gathers the whole model and every worker is
    sent every tensor whole (colocated: every worker reads rank 0's GPU): the baseline. The plan that runs
    sends each worker of a wider engine only its slices where the mode's receivers take them
    (``registry.workers_take_slices``, ``slices`` being ``--update-weight-slices``); a one-rank trainer
    then runs the rank-0 plan with those slices.
    """
    from rlplacement.transfer import registry

    from rlplacement.specs.backend import backend_spec
    from rlplacement.specs.engine import engine_spec

    spec = registry.spec(mode)
    trainer = backend_spec(backend)
    layout_args = {"world": len(layout.trainer_gpus), "tp": tp, "pp": pp, "ep": ep}
    width = layout.gpus_per_engine
    world = len(layout.trainer_gpus)
    fanout = BROADCAST if mode in ("broadcast", "broadcast_packed", "disk-delta") and not layout.colocate else WRITE
    disk = mode == "disk-delta" and not layout.colocate
    rates = LinkRates.for_mode(assumptions, spec)
    holdings = trainer_holdings(model, backend, world, tp, pp, ep)
    worker_needs = engine_spec(engine_kind).call("worker_needs", model, width)  # what each worker keeps
    receivers = [(e, w) for e in range(len(layout.engines)) for w in range(width)]
    needs = {r: worker_needs[r[1]] for r in receivers}
    if layout.colocate:
        rank_of = {gpu: r for r, gpu in enumerate(layout.trainer_gpus)}
        local = {(e, w): rank_of[layout.engines[e][w]] for e, w in receivers}
        gathered = [{} for _ in range(world)]
        for r in receivers:
            gathered[local[r]].update(needs[r])
        gather = {rank: _missing_bytes(model, holdings[rank], gathered[rank]) for rank in range(world)}
        sharded = build_plan(model, gathered, needs, fanout, local=local)
    else:
        gather = None
        sharded = _split_plan(model, holdings, worker_needs, len(layout.engines), fanout)
    whole = whole_model_needs(model, width)
    whole_needs = {r: whole[r[1]] for r in receivers}
    sliced = not layout.colocate and registry.workers_take_slices(mode, width, slices)
    run_worker_needs = worker_needs if sliced else whole  # what each worker is sent in the plan that runs
    gathered0 = rank0_holdings(model, world)
    who = spec.who_sends(colocate=layout.colocate) if world > 1 else RANK0
    if layout.colocate:
        rank0 = build_plan(model, gathered0, whole_needs, fanout)
    else:
        rank0 = _split_plan(model, gathered0, run_worker_needs if who == RANK0 else whole, len(layout.engines),
                            fanout)
    gather0 = {0: _missing_bytes(model, holdings[0], gathered0[0])}
    rpc = RPC_S_COLOCATED if layout.colocate else RPC_S
    spread = spread_sim = None
    if trainer_sends_pieces(backend, world, who, lora=False):
        # every rank sends the parts of the HF tensors it holds (transfer.pieces): nothing is gathered; an FSDP or
        # torchtitan rank its rows (a torchtitan Llama q/k weight whose rows split a head is gathered, which this
        # leaves out), a megatron rank its rows of its TP boxes, split over the data-parallel replicas
        # (BackendSpec.piece_holdings; None: the pieces are what a rank holds, so the sharded plan runs where
        # workers take slices)
        if trainer.piece_holdings is None and sliced:
            spread = sharded
        else:
            pieces = holdings if trainer.piece_holdings is None else trainer.call("piece_holdings", model, **layout_args)
            spread = _split_plan(model, pieces, run_worker_needs, len(layout.engines), fanout)
        gather_spread = {rank: 0 for rank in range(world)}
    elif who == SHARES:
        # each rank sends the share the runtime assigns it: the same rule on the same sizes
        shares = trainer.call("share_holdings", model, **layout_args)
        spread = _split_plan(model, shares, run_worker_needs, len(layout.engines), fanout)
        # a rank gathers what it sends: torchtitan from every rank's dim-0 shard, megatron from its TP peers
        gathered = shares
        gather_spread = {rank: _missing_bytes(model, holdings[rank], gathered[rank]) for rank in range(world)}
    elif who == OWN_GPU:
        # every rank gathers the whole model and hands it to the worker on its own GPU
        gathered = everywhere_holdings(model, set(local.values()), world)
        spread = build_plan(model, gathered, whole_needs, fanout, local=local)
        gather_spread = {rank: _missing_bytes(model, holdings[rank], gathered[rank]) for rank in set(local.values())}
    if spread is not None:
        spread_sim = simulate(spread, layout.trainer_gpus, layout.engines, rates, disk=disk,
                              gather_bytes=gather_spread, rpc_s=rpc)
    return PlanPair(sharded, simulate(sharded, layout.trainer_gpus, layout.engines, rates, disk=disk,
                                      gather_bytes=gather, rpc_s=rpc),
                    rank0, simulate(rank0, layout.trainer_gpus, layout.engines, rates, disk=disk, gather_bytes=gather0,
                                    rpc_s=rpc), spread, spread_sim, who)
