"""Driver side: connect a trainer actor to engine actors, and run one update across all of them
concurrently with a bounded wait.

The trainer actor mixes in :class:`rlplacement.runtime.trainer_transfer.TrainerTransferMixin`; engine
actors are of any :class:`rlplacement.engines.base.RolloutEngine` kind, of which this calls ``info``,
``init_transfer``, ``update_weights`` and ``received_checksums``.

Failure contract: ``run_update`` raises :class:`WeightUpdateError` naming every party that
failed or did not answer (engines first: a trainer error is usually the echo of an engine's).
Each engine is atomic: it either serves the new version or still serves the old one. After a
failure the group is unusable; call :func:`connect` again before the next update.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlplacement.runtime.waits import get_all, wait_named
from rlplacement.transfer.base import TransferError, UpdateResult, WeightMismatchError, WeightUpdateError


def wait_all(refs: dict[str, Any], timeout_s: float, version: int = 0) -> dict[str, Any]:
    """ray.get every ref by name within ``timeout_s``; raise WeightUpdateError naming the failures."""
    return wait_named(refs, timeout_s, error=lambda failures: WeightUpdateError(version, failures))


def engine_infos(engines: Sequence, timeout_s: float) -> list[dict]:
    """Each engine's ``info()``; ``group_size`` and ``join_refs`` read their ``num_workers``."""
    return get_all([e.info.remote() for e in engines], timeout_s, "engine info",
                   [f"engine {i}" for i in range(len(engines))])


def group_size(infos: Sequence[dict]) -> int:
    """Ranks in a transfer group: the sender (rank 0) plus every worker of every engine."""
    return 1 + sum(i["num_workers"] for i in infos)


def join_refs(engines: Sequence, infos: Sequence[dict], endpoint: dict, staging: str | None = None) -> dict[str, Any]:
    """Start every engine joining ``endpoint``, its workers on consecutive ranks from 1; refs by engine name.
    ``staging``: the engines' ``init_transfer`` argument (None: each engine's own)."""
    refs, offset = {}, 1
    for i, (engine, info) in enumerate(zip(engines, infos)):
        refs[f"engine {i}"] = engine.init_transfer.remote(endpoint, offset, staging)
        offset += info["num_workers"]
    return refs


def sender_list(trainer) -> list:
    """The sending trainer actors: ``trainer`` itself (rank 0 sends everything), or a list of them in rank
    order (every rank sends its share, each in a group of its own with every engine worker)."""
    return list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]


def sender_names(num_senders: int) -> list[str]:
    """How failures and results name the senders: ``trainer`` (rank 0), then ``trainer rank i``."""
    return ["trainer"] + [f"trainer rank {i}" for i in range(1, num_senders)]


def connect(trainer, engines: Sequence, *, timeout_s: float = 120.0, host: str | None = None,
            staging: str | None = None, per_worker: bool = False) -> dict:
    """Build the transfer groups: each sender (``trainer``: one actor or a list, :func:`sender_list`) plus
    every worker of every engine, or, with ``per_worker``, sender i plus engine worker i alone (engines in
    order, each engine's workers in order: a colocated worker and the trainer rank on its GPU). Returns the
    endpoint the engines joined (the first sender's, carrying the others'). ``staging``: how the engines
    take this group's updates (None: each engine's own)."""
    from rlplacement.transfer.multi_sender import with_more_senders

    senders = sender_list(trainer)
    names = sender_names(len(senders))
    infos = engine_infos(engines, timeout_s)
    workers = group_size(infos) - 1
    if per_worker and len(senders) != workers:
        raise TransferError(f"{len(senders)} trainer ranks for {workers} engine workers: a sender per worker needs "
                            f"one of each")
    opened = wait_named({n: s.transfer_listen.remote(2 if per_worker else workers + 1, host)
                         for n, s in zip(names, senders)}, timeout_s, "opening the transfer group")
    endpoint = with_more_senders([opened[n] for n in names], per_worker=per_worker) if len(senders) > 1 \
        else opened["trainer"]
    wait_all({**{n: s.transfer_connect.remote() for n, s in zip(names, senders)},
              **join_refs(engines, infos, endpoint, staging)}, timeout_s)
    return endpoint


def run_update(trainer, engines: Sequence, version: int, *, timeout_s: float = 120.0,
               check_equal: bool = False, graph=None, whole_each: bool = False) -> UpdateResult:
    """Send version ``version`` from the trainer (one actor, or every sending rank: :func:`sender_list`) to
    every engine at once; wait at most ``timeout_s``. The trainer's report merges the senders'.

    With ``check_equal`` each engine's received per-tensor checksums are compared with the
    trainer's; a difference raises WeightUpdateError naming the engine and the tensor (engines
    also refuse a mismatching update themselves when the group was built with check_equal).
    ``graph``: a :class:`rlplacement.runtime.update_graph.CompiledUpdate` of these actors, which makes
    the same calls through a Ray Compiled Graph. ``whole_each``: every sender sent the whole update (to the
    workers of its group, ``connect(per_worker=True)``), so the report counts it once.
    """
    from rlplacement.transfer.multi_sender import merge_sender_reports

    senders = sender_list(trainer)
    names = sender_names(len(senders))
    if graph is not None:
        results = graph.run(version, timeout_s)
    else:
        refs = {n: s.transfer_send.remote(version) for n, s in zip(names, senders)}
        refs.update({f"engine {i}": e.update_weights.remote(version) for i, e in enumerate(engines)})
        results = wait_all(refs, timeout_s, version)
    report = merge_sender_reports([results[n] for n in names], whole_each=whole_each)
    if check_equal:
        check_received(engines, report.checksums, version, timeout_s)
    return UpdateResult(version=version, trainer=report,
                        engines=tuple(results[f"engine {i}"] for i in range(len(engines))), checked=check_equal)


def check_received(engines: Sequence, expected: dict[str, str] | None, version: int, timeout_s: float) -> None:
    """Compare every engine's received checksums with the sender's ``expected``; raise WeightUpdateError
    naming the first engine and tensor that differ (or the sender, when it recorded none)."""
    if not expected:
        raise WeightUpdateError(version, {"trainer": "check_equal needs the sender set up with check_equal=True"})
    got_all = get_all([e.received_checksums.remote() for e in engines], timeout_s, "reading engine checksums",
                      [f"engine {i}" for i in range(len(engines))])
    mismatch = first_mismatch(expected, got_all)
    if mismatch is not None:
        raise WeightUpdateError(version, {f"engine {mismatch[0]}": str(mismatch[1])})


def check_base(trainers: Sequence, engines: Sequence, version: int, timeout_s: float) -> None:
    """Adapter-only LoRA updates never send the base: hold the trainer's frozen base (rank 0's gather) against
    the checkpoint each engine loaded, once; raise WeightUpdateError naming the first engine and tensor that
    differ. A tied ``lm_head.weight`` may be absent on either side."""
    names = [f"trainer rank {r}" for r in range(len(trainers))]
    trainer_side = get_all([t.base_checksums.remote() for t in trainers], timeout_s, "trainer base checksums", names)[0]
    dtypes = {name: dtype for name, (_, dtype) in trainer_side.items()}
    expected = {name: checksum for name, (checksum, _) in trainer_side.items()}
    got_all = get_all([e.checkpoint_checksums.remote(dtypes) for e in engines], timeout_s,
                      "reading engine checkpoints", [f"engine {i}" for i in range(len(engines))])
    for i, got in enumerate(got_all):
        extra = sorted(set(got) - set(expected) - {"lm_head.weight"})
        if extra:
            raise WeightUpdateError(version, {f"engine {i}": f"its checkpoint holds {extra[0]!r}, which the trainer's "
                                                             f"base does not: it loaded another model"})
        wanted = {name: want for name, want in expected.items() if name in got or name != "lm_head.weight"}
        mismatch = first_mismatch(wanted, [got])
        if mismatch is not None:
            raise WeightUpdateError(version, {f"engine {i}": f"the base it serves is not the trainer's: {mismatch[1]}; "
                                                             f"start the engines from the trainer's checkpoint, or "
                                                             f"add --lora-merge-for-rollout (full weights every update)"})


def first_mismatch(expected: dict[str, str], got_all: Sequence[dict[str, str]]) -> tuple[int, WeightMismatchError] | None:
    """The first engine whose received checksums differ from the trainer's, and the tensor; None if all agree."""
    for i, got in enumerate(got_all):
        for name, want in expected.items():
            if got.get(name, "<missing>") != want:
                return i, WeightMismatchError(name, want, got.get(name, "<missing>"))
    return None
