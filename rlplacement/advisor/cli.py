"""``rlplacement advise --metrics FILE [--json] [--plot PNG] [what-if and threshold flags]``.

Reads a telemetry JSONL, prints the diagnosis, the predicted step time of every feasible layout,
and the recommendation with its reason (``--json``: the contract object). Every field of
:class:`Thresholds` and :class:`ModelAssumptions` is a flag of the same name (:func:`flag_names`). A
flag that says what the library's own flag says has the library's name (``--rollout-max-response-len``,
``--n-samples-per-prompt``, ``--update-weight-transfer-mode``, ``--num-gpus-per-node``), so a what-if
reads like the run it describes; the advisor's older names stay as aliases, said in the help.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import json
import sys

from rlplacement.advisor.measure import measure
from rlplacement.advisor.model import Workload
from rlplacement.advisor.recommend import Advice, recommend
from rlplacement.advisor.thresholds import ModelAssumptions, Thresholds, field_help, flag_names


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("advise", help="diagnose a run's telemetry and recommend the trainer:rollout split")
    p.add_argument("--metrics", required=True, help="telemetry JSONL written by the loop (one row per step)")
    p.add_argument("--json", action="store_true", help="print the advice as one JSON object")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write a per-role timeline and a response-length histogram of the steps after the warm-up "
                        "(with --modes also PNG's name + _modes: each mode's predicted timeline)")
    p.add_argument("--plot-warmup", action="store_true",
                   help="--plot: draw the --skip-steps warm-up steps too (left out by default: a first step that "
                        "loads and compiles can take most of the time axis)")
    p.add_argument("--modes", action="store_true",
                   help="also predict sync, one-step-off and fully async at the current and the recommended split "
                        "(step time, the trainer's idle, staleness) and recommend one; needs each sample's finish "
                        "time in the rows (a run without --fully-async)")
    p.add_argument("--max-weight-staleness", type=int, default=2,
                   help="--modes: the staleness a recommended mode may reach (fully async's bound)")
    lay = p.add_argument_group("layout limits")
    lay.add_argument("--trainer-min-gpus", type=_positive_int, default=1,
                     help="the trainer's memory floor: never recommend fewer trainer GPUs")
    lay.add_argument("--trainer-multiple", type=_positive_int, default=1,
                     help="trainer GPUs must be a multiple of this (its TP x PP)")
    lay.add_argument("--num-gpus-per-node", type=_positive_int, default=None,
                     help="GPUs per node (default: the telemetry's, else 8)")
    what = p.add_argument_group("what-if (default: as measured)")
    what.add_argument("--num-gpus", type=_positive_int, default=None, help="total GPUs to lay out")
    what.add_argument("--rollout-max-response-len", "--max-response-len", dest="rollout_max_response_len",
                      type=_positive_int, default=None,
                      help="most tokens generated per sample, the library's --rollout-max-response-len "
                           "(--max-response-len: the advisor's older name, kept as an alias)")
    what.add_argument("--n-samples-per-prompt", "--group-size", dest="n_samples_per_prompt", type=_positive_int,
                      default=None, help="samples per prompt (a GRPO group), the library's --n-samples-per-prompt "
                                         "(--group-size: the advisor's older name, kept as an alias)")
    for title, cls in (("diagnosis thresholds", Thresholds), ("model assumptions", ModelAssumptions)):
        group = p.add_argument_group(title)
        for f in dataclasses.fields(cls):
            group.add_argument(*flag_names(f), dest=f"{cls.__name__}.{f.name}", type=type(f.default),
                               metavar=f.name.split("_")[-1].upper(),
                               default=f.default,
                               help=f"{field_help(cls)[f.name]} (default {f.default})".replace("%", "%%"))
    return p


def _build(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls)})


def render(advice: Advice) -> str:
    m = advice.measurement
    lines = [f"run: {m.placement} (engines of {m.gpus_per_engine}, nodes of {m.num_gpus_per_node}), "
             f"{m.steps} step(s): step {m.step_time:.3g} s = rollout {m.rollout_time:.3g} / sync {m.sync_time:.3g} / "
             f"train {m.train_time:.3g}; waits trainer {m.train_wait:.3g} rollout {m.rollout_wait:.3g}",
             *(f"warning: {w}" for w in advice.warnings),
             f"diagnosis: {advice.diagnosis.label}",
             f"{'layout':>16} {'step':>9} {'rollout':>9} {'train':>9} {'sync':>9}  path"]
    for c in advice.candidates:
        mark = "*" if c.placement == advice.recommended.placement else "x" if c.placement in advice.refused else " "
        lines.append(f"{mark}{str(c.placement):>15} {c.step_time:9.3g} {c.rollout_time:9.3g} {c.train_time:9.3g} "
                     f"{c.sync_time:9.3g}  {c.sync_path}")
    for why in dict.fromkeys(advice.refused.values()):  # each reason once, in table order
        lines.append(f"x ({', '.join(str(p) for p, w in advice.refused.items() if w == why)}): {why}")
    lines.append(f"current {m.placement}: measured {m.step_time:.3g} s, predicted {advice.current.step_time:.3g} s; "
                 f"recommended {advice.recommended.placement}: predicted {advice.recommended.step_time:.3g} s")
    lines.append(advice.reason)
    t = advice.transfer
    if t.saving_s > 0:
        lines.append(f"transfer: {t.recommended} is predicted to sync in {t.predicted_sync_s[t.recommended]:.3g} s, "
                     f"saving {t.saving_s:.3g} s per step")
    else:
        lines.append(f"transfer: keep {t.recommended} ({t.why_kept or 'no mode is predicted to sync faster'})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from rlplacement.errors import CliError
    from rlplacement.telemetry import read_rows

    try:
        thresholds, assumptions = _build(Thresholds, args), _build(ModelAssumptions, args)
        rows = read_rows(args.metrics)
        m = measure(rows, thresholds.skip_steps, thresholds.bulk_quantile, args.num_gpus_per_node, source=args.metrics)
        advice = recommend(m, thresholds=thresholds, assumptions=assumptions,
                           workload=Workload(args.rollout_max_response_len, args.n_samples_per_prompt),
                           num_gpus=args.num_gpus,
                           trainer_min_gpus=args.trainer_min_gpus, trainer_multiple=args.trainer_multiple)
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(str(exc)) from None
    if args.plot:
        from rlplacement.advisor.plot import plot

        plot(rows, args.plot, title=f"{args.metrics}: {advice.diagnosis.label}",
             skip_steps=0 if args.plot_warmup else thresholds.skip_steps)
    modes = _modes(rows, advice, thresholds.skip_steps, args.max_weight_staleness) if args.modes else None
    if modes and args.plot:
        from rlplacement.advisor import asynchrony
        from rlplacement.advisor.plot import plot_modes

        x = asynchrony.inputs_from_rows(rows, thresholds.skip_steps)
        root, ext = os.path.splitext(args.plot)
        plot_modes({mode: asynchrony.timeline(x, mode, max_staleness=args.max_weight_staleness)
                    for mode in asynchrony.MODES}, f"{root}_modes{ext or '.png'}",
                   title=f"{args.metrics}: predicted at {modes['current']['placement']}")
    if args.json:
        for w in advice.warnings:  # also where a person reads, since the JSON may go to a file or a program
            print(f"rlplacement advise: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps({**advice.to_json(), **({"modes": modes} if modes else {})}))
    else:
        print(render(advice) + (("\n" + render_modes(modes)) if modes else ""))
    return 0


def _modes(rows, advice: Advice, skip_steps: int, bound: int) -> dict:
    """Each mode predicted at the current and the recommended split (``advisor.asynchrony``), the phases moved
    by the step model's ratios; the recommended mode at the recommended split, with its flags."""
    from rlplacement.advisor import asynchrony
    from rlplacement.errors import CliError

    try:
        x = asynchrony.inputs_from_rows(rows, skip_steps)
    except ValueError as exc:
        raise CliError(f"--modes: {exc}") from None
    cur = advice.current
    sync = asynchrony.predict(x, "sync")
    other = advice.measurement.step_time - sync.step_time if not advice.measurement.overlapped else 0.0
    out = {}
    for name, pred in (("current", cur), ("recommended", advice.recommended)):
        scales = {"rollout_scale": pred.rollout_time / cur.rollout_time if cur.rollout_time else 1.0,
                  "train_scale": pred.train_time / cur.train_time if cur.train_time else 1.0}
        table = asynchrony.predict_modes(x, other=other, max_staleness=bound, **scales)
        out[name] = {"placement": str(pred.placement), "modes": [dataclasses.asdict(p) for p in table]}
    best, flags = asynchrony.recommend_mode([asynchrony.AsyncPrediction(**p) for p in out["recommended"]["modes"]],
                                            bound, colocate=advice.recommended.placement.colocate)
    out["recommended_mode"] = {"mode": best.mode, "flags": flags, "placement": out["recommended"]["placement"],
                               "step_time": best.step_time}
    return out


def render_modes(modes: dict) -> str:
    lines = [f"{'split':>16} {'mode':>20} {'step':>8} {'trainer idle':>13} {'staleness mean/max':>19}"]
    for name in ("current", "recommended"):
        for p in modes[name]["modes"]:
            lines.append(f"{modes[name]['placement']:>16} {p['mode']:>20} {p['step_time']:8.3g} "
                         f"{p['train_wait_time']:13.3g} {p['mean_staleness']:>12.2f}/{p['max_staleness']}")
    r = modes["recommended_mode"]
    lines.append(f"recommended mode: {r['mode']} at {r['placement']}, predicted {r['step_time']:.3g} s a step"
                 + (f": {r['flags']}" if r["flags"] else ""))
    return "\n".join(lines)
