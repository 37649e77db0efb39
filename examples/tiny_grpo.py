"""A tiny end-to-end GRPO loop on the embedded default: local Ray with logical GPUs, CPU vLLM
engines, a tiny model made offline. Every rlplacement flag works here.

    python examples/tiny_grpo.py [any rlplacement flag] [--steps N] [--telemetry FILE.jsonl]

Per step: G samples per prompt from the engines -> reward (how often the response uses the
target token) -> group-normalised advantages -> one optimizer step -> weights to the engines
(a new version) -> one telemetry row. With --check-weight-update-equal a mismatch between the
trainer's and an engine's weights exits non-zero naming the tensor. With --one-step-off (split layouts) step k+1
generates while step k trains (``RLJob.one_step_off``): samples one version stale, the loss's ratio against the
engine's log-probs. With --fully-async the engines generate groups continuously (``RLJob.fully_async``): each step
trains on the first --prompts-per-step groups ready within --max-weight-staleness and updates the engines while
they generate (--pause-generation-mode). --use-tis weighs each token by the truncated trainer-over-engine ratio.
With --save the loop checkpoints every --save-interval steps, or once after its last step when no interval
is given. With --save and --load a run stopped after a checkpoint and resumed goes on as if never stopped: the
checkpoint keeps the prompt sampler's position and the next step's number (``RLJob.save_checkpoint``'s
``extra_state``), the job keeps its rollout seeds, so the resumed steps draw the same prompts with the
same seeds on the same weights. (Under --one-step-off the rollout in flight at the save is not in it:
the resumed run generates those prompts again, on the checkpoint's weights, with the next seeds.)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import rlplacement
from rlplacement.errors import ConfigError

# The embedded default: 1 trainer rank and 1 one-GPU engine on a 4-GPU logical node; the FSDP
# backend loads the HF folder as it is; the tiny model learns at lr 3e-3 (RL runs of real models use
# ~1e-6, the library's default). Any flag given on the command line wins.
EXAMPLE_DEFAULTS = dict(actor_num_gpus_per_node=1, rollout_num_gpus=1, num_gpus_per_node=4,
                        train_backend="fsdp", lr=3e-3, n_samples_per_prompt=4, rollout_max_response_len=16,
                        rollout_seed=0)
# the loop's own spellings of the library's flags, kept as aliases
FLAG_ALIASES = {"--group-size": "n_samples_per_prompt", "--max-response-len": "rollout_max_response_len",
                "--seed": "rollout_seed"}
PROMPTS = ["what is two plus three ?", "count : 1 2 3", "the quick brown fox", "one two three four"]
TINY_MODEL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # 2 KV heads: TP=2 works
# --tiny-model-family qwen3_moe: every layer sparse, 4 experts of 64, top-2
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
LORA_HEAD_STD = 0.2  # the tiny model's output layer under --lora-rank: see main
DIGITS = "0123456789"  # reward: fraction of response tokens that are digits


def build_parser() -> argparse.ArgumentParser:
    parser = rlplacement.args.ArgumentParser(description=__doc__.splitlines()[0])  # "did you mean" for a typo
    rlplacement.add_arguments(parser)
    parser.set_defaults(**EXAMPLE_DEFAULTS)
    g = parser.add_argument_group("example loop", "With --save and no --save-interval the loop saves one "
                                                  "checkpoint, after its last step.")
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--telemetry", type=str, default=None, help="write one JSON row per step here")
    g.add_argument("--prompts-per-step", type=int, default=2)
    g.add_argument("--long-tail", action="store_true", help="response lengths drawn from a Pareto tail, each step's "
                   "longest at --rollout-max-response-len, generated exactly that long: the tail gates the rollout")
    g.add_argument("--long-tail-alpha", type=float, help="--long-tail's Pareto exponent (default 1.5): p99/p50 of "
                   "the draws is 50^(1/alpha), about 7 at 2 (published RL workloads: 5-10)")
    g.add_argument("--long-tail-min", type=int, help="--long-tail's shortest response in tokens (default 2)")
    for alias, dest in FLAG_ALIASES.items():
        if alias not in parser._option_string_actions:
            g.add_argument(alias, dest=dest, type=int, help=argparse.SUPPRESS)
    g.add_argument("--work-dir", type=str, default=None, help="where the tiny model is made (default: a temp dir)")
    from rlplacement.models.tiny import FAMILIES

    g.add_argument("--tiny-model-family", choices=FAMILIES, default="qwen3",
                   help="the tiny model's family (qwen3_moe: a mixture of experts); ignored with --hf-checkpoint")
    return parser


def tiny_model_dtype() -> str:
    """The made model's declared dtype, which the engines serve: bf16 where a GPU trains in mixed
    precision (as real checkpoints are published), fp32 on a CPU host, whose trainer trains fp32 (the
    loop's log-prob check then compares like with like)."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def tail_shape(args: argparse.Namespace, max_len: int) -> dict:
    """``--long-tail-alpha`` / ``--long-tail-min`` (defaults 1.5 and 2) as :func:`long_tail_lengths` takes them."""
    flags = {"--long-tail-alpha": args.long_tail_alpha, "--long-tail-min": args.long_tail_min}
    given = [flag for flag, value in flags.items() if value is not None]
    if given and not args.long_tail:
        raise ConfigError(f"{' and '.join(given)} shape --long-tail's lengths: add --long-tail, or drop them")
    alpha = 1.5 if args.long_tail_alpha is None else args.long_tail_alpha
    minimum = 2 if args.long_tail_min is None else args.long_tail_min
    if alpha <= 0 or not 1 <= minimum <= max_len:
        raise ConfigError(f"--long-tail-alpha {alpha} must be > 0, --long-tail-min {minimum} from 1 to {max_len}")
    return {"alpha": alpha, "minimum": minimum}


def long_tail_lengths(n: int, max_len: int, seed: int, alpha: float = 1.5, minimum: int = 2) -> list[int]:
    """``n`` response lengths from a Pareto(alpha) tail above ``minimum``, capped at ``max_len``; one of
    them is ``max_len`` so every step has its straggler (with a few samples a draw may have none)."""
    rng = random.Random(seed)
    lengths = [min(max_len, int(minimum * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]
    lengths[rng.randrange(n)] = max_len
    return lengths


class Tokens:
    """The folder's tokenizer as the loop uses it (prompt ids, the digits' ids, the pad id), read with
    ``tokenizers`` from its ``tokenizer.json`` where it has one: transformers' tokenizer classes cost the
    loop's start seconds of imports. Else transformers' ``AutoTokenizer``, which reads any folder."""

    def __init__(self, hf_dir: str):
        import json
        import os

        path = os.path.join(hf_dir, "tokenizer.json")
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(path)
            with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
                pad = json.load(f).get("pad_token")
            pad = pad.get("content") if isinstance(pad, dict) else pad
            self.encode = lambda text: fast.encode(text).ids
            self.token_id = fast.token_to_id
            self.pad_id = (fast.token_to_id(pad) if pad else None) or 0
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(hf_dir)
            self.encode, self.token_id, self.pad_id = tok.encode, tok.convert_tokens_to_ids, tok.pad_token_id or 0


class PromptSampler:
    """The loop's prompts in a fixed cycle. ``position``: prompts drawn so far, what a checkpoint keeps so a
    resumed run draws on where the stopped one would have."""

    def __init__(self, prompts: list[list[int]], position: int = 0):
        self.prompts, self.position = prompts, position

    def draw(self, n: int) -> list[list[int]]:
        chosen = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(n)]
        self.position += n
        return chosen


def reward(sample, targets: set[int]) -> float:
    """The loop's reward: the fraction of ``sample``'s response tokens that are digits (``targets``)."""
    return sum(int(t) in targets for t in sample.token_ids) / max(len(sample.token_ids), 1)


def make_batch(samples, rewards: list[float], group_size: int, pad_id: int, behaviour: bool = False,
               routes: bool = False, versions: bool = False) -> rlplacement.Batch:
    """Right-padded input_ids, a loss mask on response tokens, group-normalised advantages and each
    sample's length; with ``behaviour`` also the engine's log-probs at the sampled tokens' positions
    (``old_logprobs``), which the loss uses for stale samples' importance ratio; with ``routes`` the experts
    the engine routed every token to (``--use-rollout-routing-replay``); with ``versions`` the version that sampled
    each token (the job masks with them under ``--mask-offpolicy-in-partial-rollout``)."""
    import torch

    advantages = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        mean, std = statistics.fmean(group), statistics.pstdev(group)
        advantages += [(r - mean) / (std + 1e-6) for r in group]
    lengths = [len(s.prompt_ids) + len(s.token_ids) for s in samples]
    input_ids = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(input_ids.shape)
    old_logprobs = torch.zeros(input_ids.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        input_ids[i, :p] = torch.tensor(s.prompt_ids)
        input_ids[i, p:lengths[i]] = torch.tensor(s.token_ids)
        loss_mask[i, p:lengths[i]] = 1.0
        old_logprobs[i, p:lengths[i]] = torch.tensor(s.logprobs)
    width = input_ids.shape[1]
    return rlplacement.Batch(input_ids, loss_mask, torch.tensor(advantages, dtype=torch.float32),
                             old_logprobs if behaviour else None, torch.tensor(lengths),
                             rlplacement.routed_experts_of(samples, width) if routes else None,
                             token_versions=rlplacement.token_versions_of(samples, width) if versions else None)


def run(args: argparse.Namespace) -> int:
    from rlplacement.models.tiny import TinySpec, make_tiny_model
    from rlplacement.telemetry.recorder import RunLayout, StepRecorder
    from rlplacement.telemetry.trackers import build_trackers

    config = rlplacement.config_from_args(args)  # every flag checked before any process starts
    if args.telemetry:
        from rlplacement.atomic_files import check_writable

        check_writable(str(Path(args.telemetry).resolve().parent), f"--telemetry {args.telemetry}: its folder")
    group_size, max_len = config.rollout.n_samples_per_prompt, config.rollout.max_response_len
    dp = config.placement.trainer_num_gpus // (config.backend.tensor_model_parallel_size
                                                * config.backend.pipeline_model_parallel_size)
    if (args.prompts_per_step * group_size) % dp:
        raise ConfigError(f"--prompts-per-step x --n-samples-per-prompt = {args.prompts_per_step * group_size} "
                          f"samples must split evenly over {dp} data-parallel trainer ranks")
    args.tail = tail_shape(args, max_len)
    if config.backend.hf_checkpoint:  # a folder given: checked (named, no traceback) before its tokenizer is read
        from rlplacement.backends import preflight

        preflight(config.backend)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tiny_grpo_"))
    moe = TINY_MOE if args.tiny_model_family == "qwen3_moe" else {}
    # LoRA adapts the decoder's linear layers only; behind HF's random head (std 0.02) the RMS-normed hidden
    # states of width 128 reach logits of about +-2.6 at most, so adapters cannot make digits likely (checked:
    # 0.02 -> ~0.1 in 40 steps at any lr to 1e-1, and at rank 64). A LoRA run's tiny model has a wider head.
    head = {"lm_head_std": LORA_HEAD_STD} if config.backend.lora.enabled else {}
    hf_dir = config.backend.hf_checkpoint or str(make_tiny_model(work / "model", TinySpec(
        **TINY_MODEL, **moe, **head, family=args.tiny_model_family, dtype=tiny_model_dtype())))
    tok = Tokens(hf_dir)
    targets = {tok.token_id(d) for d in DIGITS}
    prompts = [tok.encode(p) for p in PROMPTS]

    # trackers first: a bad W&B or TensorBoard set-up fails before Ray starts; they close after the job
    with build_trackers(config.tracking, run_config=config) as trackers, \
            rlplacement.RLJob.start(config, hf_dir) as job:
        tel = StepRecorder(args.telemetry, RunLayout.from_placement(
            config.placement, transfer_mode=config.transfer.mode,
            max_response_len=max_len, group_size=group_size,
            prompt_len=round(statistics.fmean(len(p) for p in prompts)), **job.engine_capacity()), trackers=trackers)
        one_step_off = config.placement.one_step_off
        # where a --load resumes: the step after the checkpoint's and its sampler position ({} when fresh)
        first_step = job.resumed_extra_state.get("step", 0)
        last_step = first_step + args.steps
        sampler = PromptSampler(prompts, job.resumed_extra_state.get("prompt_position", 0))
        resume_point = {"step": first_step, "prompt_position": sampler.position}
        job.checkpoint_extra_state = lambda: dict(resume_point)  # what every --save-interval save records
        if config.async_rollout.fully_async:
            return run_fully_async(args, config, job, tel, sampler, targets, tok.pad_id, first_step,
                                   last_step, resume_point)
        if config.train.train_during_rollout:
            return run_train_during_rollout(args, config, job, tel, sampler, targets, tok.pad_id, range(first_step,
                                                                                                      last_step),
                                            resume_point)

        def start_rollout(step: int):
            chosen = sampler.draw(args.prompts_per_step)
            lengths = (long_tail_lengths(len(chosen) * group_size, max_len, config.rollout.seed + step, **args.tail)
                       if args.long_tail else None)
            job.prepare_rollout()  # --colocate hand-off, timed apart from the phases (perf/handoff_*)
            # samples of a prompt are consecutive (index = prompt * group_size + sample): make_batch's groups
            return time.time(), job.generate_async(chosen, max_tokens=lengths, exact_lengths=args.long_tail), \
                sampler.position

        if one_step_off:  # step k+1 generates (on the current weights) while k trains: RLJob.one_step_off
            positions = []  # the sampler's position after each batch's prompts, in batch order

            def draw(n: int) -> list[list[int]]:
                chosen = sampler.draw(n)
                positions.append(sampler.position)
                return chosen

            def budgets(n: int) -> list[int]:  # called right after its batch's draw: seeded by that batch's step
                seed = config.rollout.seed + first_step + len(positions) - 1
                return long_tail_lengths(n, max_len, seed, **args.tail)

            rollout = job.one_step_off(draw, args.prompts_per_step, max_tokens=budgets if args.long_tail else None,
                                       exact_lengths=args.long_tail)
        else:
            t0, pending, drawn = start_rollout(first_step)
        for step in range(first_step, last_step):
            if one_step_off:
                samples = rollout.next_samples(start_next=step + 1 < last_step)
                t0, drawn = rollout.started_at, positions[step - first_step]
            else:
                samples = job.collect(pending)
            tel.record_interval("rollout", t0, max(s.finished_at for s in samples))
            tel.record_samples([len(s.token_ids) for s in samples], [s.finished_at - t0 for s in samples])
            resume_point.update(step=step + 1, prompt_position=drawn)  # this step's prompts are trained next
            staleness = job.version - min(s.weight_version for s in samples)  # versions behind the trainer
            rewards = [reward(s, targets) for s in samples]
            batch = make_batch(samples, rewards, group_size, tok.pad_id,
                               behaviour=one_step_off or config.train.use_tis,
                               routes=config.backend.moe.rollout_routing_replay)
            job.prepare_train()
            with tel.phase("train", role="trainer"):  # trainer work: the forward for the log-prob check
                trainer_lp = job.log_probs(batch)
            tel.record_logprobs([row[len(s.prompt_ids):len(s.prompt_ids) + len(s.token_ids)]
                                 for row, s in zip(trainer_lp, samples)], [s.logprobs for s in samples])
            if config.train.use_tis:  # as under --fully-async: PPO against the trainer, TIS trainer over engine
                batch = with_tis_logprobs(batch, trainer_lp)
            reports = job.train(batch)
            for rank_report in reports:
                tel.record_interval("train", rank_report.start, rank_report.end)
            job.prepare_update()
            t_sync = time.time()
            report = job.update_weights()  # None between the updates of --update-weights-interval
            tel.record_interval("sync", t_sync, time.time())  # engines apply it after their current batch
            if not one_step_off and step + 1 < last_step:
                t0, pending, drawn = start_rollout(step + 1)
            sync_metrics = dict(report.trainer.metrics) if report else {}  # disk-delta: its density and wire bytes
            sync_metrics["perf/update_weights_checked"] = int(bool(report and report.checked))
            sync_metrics.update({"train/loss": reports[0].loss, "train/grad_norm": reports[0].grad_norm,
                                 "train/lr": reports[0].lr, "train/skipped_steps": reports[0].skipped_steps})
            if one_step_off:
                sync_metrics["rollout/staleness"] = staleness
            sync_metrics.update(job.pop_handoff_metrics())
            row = tel.end_step(step, reward=statistics.fmean(rewards), **sync_metrics)
            print_step(step, row, report, job.version, f"  staleness {staleness}" if one_step_off else "")
        save_at_end(config, job)
    return 0


def run_train_during_rollout(args, config, job, tel, sampler, targets, pad_id: int, steps: range, resume_point) -> int:
    """``--train-during-rollout``: the groups of a step's rollout train as they finish (``job.finished_groups``,
    gathered into chunks of a multiple of the data-parallel size in samples), the one optimizer step after the
    last; the recorder's ``perf/train_overlap_time`` is the chunks' training inside the rollout's interval."""
    group_size, max_len = config.rollout.n_samples_per_prompt, config.rollout.max_response_len
    for step in steps:
        chosen = sampler.draw(args.prompts_per_step)
        lengths = long_tail_lengths(len(chosen) * group_size, max_len, config.rollout.seed + step, **args.tail) \
            if args.long_tail else None
        t0 = time.time()
        pending = job.generate_async(chosen, max_tokens=lengths, exact_lengths=args.long_tail)
        samples, waiting, rewards = [], [], []
        for group in job.finished_groups(pending, group_size):
            waiting += group
            if len(waiting) % job.data_parallel_size:
                continue
            chunk_rewards = [reward(s, targets) for s in waiting]
            batch = make_batch(waiting, chunk_rewards, group_size, pad_id, behaviour=config.train.use_tis,
                               routes=config.backend.moe.rollout_routing_replay)
            trainer_lp = job.log_probs(batch)  # after the chunks before it, on the weights that sampled every group
            tel.record_logprobs([row[len(s.prompt_ids):len(s.prompt_ids) + len(s.token_ids)]
                                 for row, s in zip(trainer_lp, waiting)], [s.logprobs for s in waiting])
            job.train_chunk(with_tis_logprobs(batch, trainer_lp) if config.train.use_tis else batch)
            samples, rewards, waiting = samples + waiting, rewards + chunk_rewards, []
        rollout_end = max(s.finished_at for s in samples)
        tel.record_interval("rollout", t0, rollout_end)
        tel.record_samples([len(s.token_ids) for s in samples], [s.finished_at - t0 for s in samples])
        resume_point.update(step=step + 1, prompt_position=sampler.position)
        reports, chunks = job.finish_train_during_rollout()
        for start, end in chunks + [(reports[0].start, reports[0].end)]:
            tel.record_interval("train", start, end)
        job.prepare_update()
        t_sync = time.time()
        report = job.update_weights()
        tel.record_interval("sync", t_sync, time.time())
        metrics = {"rollout/dropped_groups": pending.dropped_groups,
                   "rollout/generated_again": pending.generated_again, "train/loss": reports[0].loss,
                   "train/grad_norm": reports[0].grad_norm, "train/lr": reports[0].lr,
                   "train/skipped_steps": reports[0].skipped_steps,
                   "perf/update_weights_checked": int(bool(report and report.checked))}
        row = tel.end_step(step, reward=statistics.fmean(rewards), **metrics)
        print_step(step, row, report, job.version, f"  overlap {row['perf/train_overlap_time']:.2f}s")
    save_at_end(config, job)
    return 0


def save_at_end(config, job) -> None:
    """``--save`` without ``--save-interval``: one checkpoint after the last step. The library writes one every
    ``--save-interval`` train steps and none without it; a loop that was given a folder keeps its training."""
    if config.train.save and config.train.save_interval is None:
        folder = job.save_checkpoint()
        sys.stdout.write(f"tiny_grpo: saved the last step's checkpoint to {folder}\n")
        sys.stdout.flush()


def with_tis_logprobs(batch: rlplacement.Batch, trainer_lp) -> rlplacement.Batch:
    """``--use-tis``: the PPO ratio against the trainer's own log-probs at the step's start (``trainer_lp``), each
    token weighted by the truncated trainer-over-engine ratio; ``batch.old_logprobs`` must hold the engine's
    log-probs (``make_batch(..., behaviour=True)``), which become ``rollout_logprobs``."""
    import dataclasses

    return dataclasses.replace(batch, old_logprobs=trainer_lp, rollout_logprobs=batch.old_logprobs)


def print_step(step: int, row: dict, report, version: int, tail: str = "") -> None:
    line = (f"step {step}: reward {row['reward']:.3f}  rollout {row['perf/rollout_time']:.2f}s  "
            f"train {row['perf/train_time']:.2f}s  sync {row['perf/update_weights_time']:.2f}s "
            f"({(report.trainer.bytes if report else 0) / 1e6:.1f} MB, v{version})"
            f"{' checked' if report and report.checked else ''}  "
            f"logprob diff {row['rollout/logprob_abs_diff']:.2e}" + tail)
    # One write with its newline: Ray's log thread shares this stdout, and print's two
    # writes (text, then "\n") let a worker's line land between them.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_fully_async(args, config, job, tel, sampler, targets, pad_id: int, first_step: int, last_step: int,
                    resume_point: dict) -> int:
    """``--fully-async``: the engines generate groups continuously (``RLJob.fully_async``); each step trains
    on the first ``--prompts-per-step`` groups ready within ``--max-weight-staleness`` and updates the engines
    while they generate. The loss's behaviour policy is the engine's log-probs; with ``--use-tis`` the PPO
    ratio is against the trainer's log-probs at the step's start, each token weighted by the truncated
    trainer-over-engine ratio."""
    group_size, max_len = config.rollout.n_samples_per_prompt, config.rollout.max_response_len
    drawn = {"n": 0}

    def lengths(n: int) -> list[int]:  # a long tail per top-up, drawn reproducibly
        drawn["n"] += 1
        return long_tail_lengths(n, max_len, config.rollout.seed + 7919 * drawn["n"], **args.tail)

    with job.fully_async(sampler.draw, max_tokens=lengths if args.long_tail else None,
                         exact_lengths=args.long_tail) as rollout:
        for step in range(first_step, last_step):
            groups, stats = rollout.next_groups(args.prompts_per_step)
            samples = [s for g in groups for s in g]
            for start, end in rollout.pop_busy_intervals():
                tel.record_interval("rollout", start, end)
            tel.record_samples([len(s.token_ids) for s in samples])
            resume_point.update(step=step + 1, prompt_position=sampler.position)
            rewards = [reward(s, targets) for s in samples]
            batch = make_batch(samples, rewards, group_size, pad_id, behaviour=True,
                               routes=config.backend.moe.rollout_routing_replay,
                               versions=True)
            with tel.phase("train", role="trainer"):
                trainer_lp = job.log_probs(batch)
            tel.record_logprobs([row[len(s.prompt_ids):len(s.prompt_ids) + len(s.token_ids)]
                                 for row, s in zip(trainer_lp, samples)], [s.logprobs for s in samples])
            if config.train.use_tis:
                batch = with_tis_logprobs(batch, trainer_lp)
            reports = job.train(batch)
            for rank_report in reports:
                tel.record_interval("train", rank_report.start, rank_report.end)
            t_sync = time.time()
            report = rollout.update_weights()
            tel.record_interval("sync", t_sync, time.time())
            metrics = dict(report.trainer.metrics) if report else {}
            metrics.update(stats.metrics())
            metrics.update({"perf/update_weights_checked": int(bool(report and report.checked)),
                            "train/loss": reports[0].loss, "train/grad_norm": reports[0].grad_norm,
                            "train/lr": reports[0].lr, "train/skipped_steps": reports[0].skipped_steps})
            row = tel.end_step(step, reward=statistics.fmean(rewards), **metrics)
            print_step(step, row, report, job.version,
                       f"  staleness {stats.metrics()['rollout/staleness']}"
                       f" (filtered {stats.stale_groups_filtered})")
    save_at_end(config, job)  # the engines have stopped generating: the trainer's state is the last step's
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ConfigError as exc:
        print(f"tiny_grpo: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a weight mismatch or a failed update: say which, exit non-zero
        if isinstance(exc, rlplacement.TransferError):
            print(f"tiny_grpo: weight update failed: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
