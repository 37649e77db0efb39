"""The recommended layout: the best predicted among the placement layer's feasible splits and colocate.

Invariants of the result: the same total GPUs as the run (or ``--num-gpus`` in a what-if); the
rollout side is whole engines; splits come from
:func:`rlplacement.placement.layout.feasible_splits`, so node boundaries and the trainer's
memory floor (``trainer_min_gpus``) and TP x PP multiple hold; colocating across nodes keeps each engine
inside a node (as the flags require); a ``long-tail`` run is never given
more rollout GPUs; a change is proposed only when predicted to cut the measured step by at least
``min_gain``, and its gain is stated against the measured step (under a ``Workload`` what-if, which
changes the job, against the current layout's prediction for it).

Never a layout the run's own flags refuse (``rlplacement/args``): the recommendation changes only the
layout flags, so a candidate that the run's other flags would refuse (colocating a ``--one-step-off``
run, or one whose ``--update-weight-transfer-mode`` is refused with ``--colocate``; splitting a run
given ``--offload-*``) is predicted and shown, marked with the flag that refuses it, never recommended.
"""

from __future__ import annotations

import dataclasses

from rlplacement.advisor.diagnose import Diagnosis, diagnose
from rlplacement.advisor.measure import Measurement, Placement
from rlplacement.advisor.model import Prediction, StepModel, Workload, fit
from rlplacement.advisor.thresholds import ModelAssumptions, Thresholds
from rlplacement.advisor.transfer_mode import ModeAdvice, advise_transfer_mode
from rlplacement.placement.layout import feasible_splits
from rlplacement.transfer import registry


@dataclasses.dataclass(frozen=True)
class Advice:
    diagnosis: Diagnosis
    current: Prediction
    recommended: Prediction
    candidates: tuple[Prediction, ...]
    measurement: Measurement
    reason: str
    transfer: ModeAdvice
    warnings: tuple[str, ...] = ()  # printed before the advice, in the JSON as "warnings"
    baseline: str = "measured"  # what the gain is against: "measured" (the measured step) or "what-if"
    refused: dict[Placement, str] = dataclasses.field(default_factory=dict)  # candidate -> the flag that refuses it

    @property
    def baseline_step_time(self) -> float:
        """The step the gain is against: the measured one, or the current layout's under a what-if."""
        return self.measurement.step_time if self.baseline == "measured" else self.current.step_time

    @property
    def predicted_change(self) -> float:
        """Recommended step / baseline step - 1 (negative: faster)."""
        base = self.baseline_step_time
        return self.recommended.step_time / base - 1 if base > 0 else 0.0

    def to_json(self) -> dict:
        """The ``rlplacement advise --json`` object (its fields: docs/advisor.md)."""
        m = self.measurement
        return {
            "diagnosis": self.diagnosis.label,
            "reason": self.reason,
            "warnings": list(self.warnings),
            "current": self.current.placement.to_json(),
            "recommended": self.recommended.placement.to_json(),
            "predicted_step_time": {"current": self.current.step_time, "recommended": self.recommended.step_time},
            "measured_step_time": m.step_time,
            "predicted_change": self.predicted_change,
            "predicted_change_against": ("measured_step_time" if self.baseline == "measured"
                                         else "predicted_step_time.current"),
            "measured": {"steps": m.steps, "rollout_time": m.rollout_time, "train_time": m.train_time,
                         "sync_time": m.sync_time, "update_weights_time": m.update_weights_time,
                         "train_wait_time": m.train_wait,
                         "rollout_wait_time": m.rollout_wait, "rollout_tail": m.rollout_tail,
                         "sample_finish_p50": m.finish_p50, "sample_finish_p99": m.finish_p99,
                         "overlapped": m.overlapped, "gpus_per_engine": m.gpus_per_engine,
                         "num_gpus_per_node": m.num_gpus_per_node},
            "candidates": [{**c.to_json(), "refused": self.refused.get(c.placement)} for c in self.candidates],
            "recommended_transfer_mode": self.transfer.recommended,
            "transfer_mode_saving_s": self.transfer.saving_s,
            "transfer_mode_predicted_sync_s": self.transfer.predicted_sync_s,
        }


def candidate_placements(total_gpus: int, num_gpus_per_node: int, gpus_per_engine: int,
                         trainer_min_gpus: int = 1, trainer_multiple: int = 1) -> list[Placement]:
    """Feasible splits (from the placement layer) plus colocate on all GPUs when that is valid: whole engines,
    each inside a node (one node, or whole nodes each holding whole engines: what the flags allow), the
    trainer's floor and multiple."""
    out = [Placement(False, s.trainer_gpus, s.rollout_gpus)
           for s in feasible_splits(total_gpus, num_gpus_per_node, gpus_per_engine, trainer_min_gpus, trainer_multiple)]
    inside_nodes = total_gpus <= num_gpus_per_node or (total_gpus % num_gpus_per_node == 0
                                                       and num_gpus_per_node % gpus_per_engine == 0)
    if (total_gpus >= trainer_min_gpus and total_gpus % gpus_per_engine == 0
            and total_gpus % trainer_multiple == 0 and inside_nodes):
        out.append(Placement(True, total_gpus, total_gpus))
    return out


def refusal(p: Placement, m: Measurement) -> str | None:
    """Why the measured run's flags (other than the layout's own) refuse layout ``p``; None: they allow it."""
    if p.colocate and not m.placement.colocate:
        if m.one_step_off:
            return ("--colocate refuses --one-step-off, which this run used (generation cannot overlap training on "
                    "shared GPUs): measure a run without --one-step-off to be advised on colocating")
        spec = registry.specs().get(m.transfer_mode or "")
        if spec is not None and not spec.named_under_colocate:
            usable = " or ".join(name for name, s in registry.specs().items() if s.named_under_colocate)
            return (f"--colocate refuses --update-weight-transfer-mode {m.transfer_mode}, which this run used: "
                    f"measure a run with {usable} to be advised on colocating")
    if not p.colocate and m.placement.colocate and m.split_refused_by:
        flags = " and ".join(m.split_refused_by)
        return (f"a split layout refuses {flags}, which this run was given (each side keeps its own GPUs): "
                f"measure a run without {flags} to be advised on splitting")
    return None


def _describe_change(cur: Placement, rec: Placement) -> str:
    if rec == cur:
        return f"keep {cur}"
    if rec.colocate:
        return f"colocate on all {rec.total_gpus} GPUs (from {cur})"
    if cur.colocate:  # the model assumes a colocated run's splits overlap generation with training
        return f"split {rec} trainer:rollout with --one-step-off (from {cur})"
    if rec.total_gpus == cur.total_gpus:
        moved = rec.rollout_gpus - cur.rollout_gpus
        side = "to rollout" if moved > 0 else "to the trainer"
        return f"move {abs(moved)} GPU(s) {side} ({cur} -> {rec} trainer:rollout)"
    return f"use {rec} trainer:rollout on {rec.total_gpus} GPUs (from {cur})"


def recommend(m: Measurement, *, thresholds: Thresholds = Thresholds(),
              assumptions: ModelAssumptions = ModelAssumptions(), workload: Workload = Workload(),
              num_gpus: int | None = None, trainer_min_gpus: int = 1, trainer_multiple: int = 1) -> Advice:
    model: StepModel = fit(m, assumptions)
    diag = diagnose(m, thresholds)
    total = num_gpus or m.placement.total_gpus
    places = candidate_placements(total, m.num_gpus_per_node, m.gpus_per_engine, trainer_min_gpus, trainer_multiple)
    if diag.label == "long-tail":  # a what-if cap or group only lengthens the tail further
        places = [p for p in places if p.rollout_gpus <= m.placement.rollout_gpus]
    if not places:
        raise ValueError(
            f"no layout of {total} GPUs fits engines of {m.gpus_per_engine} GPU(s) on nodes of "
            f"{m.num_gpus_per_node} with a trainer of at least {trainer_min_gpus} GPU(s) (multiple of "
            f"{trainer_multiple}): lower --trainer-min-gpus/--trainer-multiple or raise --num-gpus")
    preds = tuple(model.predict(p, workload) for p in places)
    refused = {p: why for p in places if (why := refusal(p, m)) is not None}
    allowed = [p for p in preds if p.placement not in refused]
    if not allowed:
        raise ValueError(f"every layout of {total} GPUs is refused by this run's flags: "
                         + "; ".join(sorted(set(refused.values()))))
    current = model.predict(m.placement, workload)
    # the gain is against the measured step; a what-if of the workload changes the job, so there it is
    # against the current layout's prediction for the changed job
    baseline = "what-if" if workload != Workload() else "measured"
    base = m.step_time if baseline == "measured" else current.step_time
    base_text = (f"the measured {base:.3g} s" if baseline == "measured"
                 else f"{base:.3g} s (predicted for {m.placement} under the what-if)")
    best = min(allowed, key=lambda p: (p.step_time, p.placement.colocate is False))
    keep = next((p for p in allowed if p.placement == m.placement), None)
    if keep is not None and best.step_time > base * (1 - thresholds.min_gain):
        best = keep
    if best.placement == m.placement:
        reason = (f"{diag.label}: {diag.why}; keep {m.placement} ({base_text}): no feasible layout that this run's "
                  f"flags allow is predicted to cut it by {thresholds.min_gain:.0%}.")
    else:
        change = best.step_time / base - 1 if base > 0 else 0.0
        reason = (f"{diag.label}: {diag.why}; {_describe_change(m.placement, best.placement)} is predicted to take "
                  f"the step from {base_text} to {best.step_time:.3g} s ({change:+.0%}).")
    return Advice(diag, current, best, preds, m, reason, advise_transfer_mode(m, assumptions, thresholds.min_gain),
                  warnings=m.warnings, baseline=baseline, refused=refused)
