"""Chaos soak: the example loop's steps (``examples/tiny_grpo.py``) under ``--use-fault-tolerance`` with a
seeded schedule of faults, and the run's invariants checked after every step.

    python benchmarks/chaos_soak.py [--steps 30] [--faults 6] [--seed 0] [--json OUT.json] [any rlplacement flag]

Faults (one per chosen step; the schedule is drawn from ``--seed`` and cycles through the kinds the mode has):

* ``engine_killed_before_update``: an engine's process killed (SIGKILL through Ray) after training, before
  the update: the update finds it dead, it is restarted and the update goes again under a fresh number;
* ``engine_killed_during_update``: the trainer's weight source paused 3 s at its second tensor and the engine
  killed 1 s in;
* ``engine_killed_after_update``: killed once its update landed: the next rollout's health check restarts it;
* ``receiver_stalled``: an engine's process stopped (SIGSTOP) during an update and left stopped: the update
  names it after the job's timeout and the health check kills and restarts it;
* ``trainer_killed``: trainer rank 0 killed before its train step: the trainer restarts from the last
  ``--save`` (the example saves every ``--save-interval`` calls) and the step trains again, engines kept;
* ``corrupted_delta_file`` (disk-delta): a byte flipped in the newest version's largest file (a shard, or the
  index when the delta changed no tensor) after it was published, before one engine read it: that engine
  refuses the version by its checksum or signature and the retry lands;
* ``disk_full`` (disk-delta, where a tmpfs can be mounted: root): the folder's filesystem filled to its last
  byte before an update: the update fails with nothing published half-written, the space is freed, the next rollout
  brings every engine to the trainer's weights.

Invariants after every step (a violation stops the run with exit status 1): every live engine serves one
whole version, the job's, and took exactly the trainer's bytes (per-tensor checksums; every update is also
checked by ``--check-weight-update-equal``); every sample was generated from the version every engine served
when it was generated (no sample from an unnamed version); versions never go backwards and the epoch moves
only with a recorded trainer restart; open files, /dev/shm, live Ray actors, the driver's resident memory and
the memory the trainer's p2p sender keeps registered with Mooncake stay within a bound of their value after
the first steps. The table printed at the end: faults injected per
kind, recovered, seconds to recover (from the fault to the end of its step, invariants holding), and steps
lost (trainer calls a restart rolled back).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run_facts import run_facts  # noqa: E402
from examples import tiny_grpo  # noqa: E402

ALWAYS = ("engine_killed_before_update", "engine_killed_during_update", "engine_killed_after_update",
          "receiver_stalled", "trainer_killed")
DISK_DELTA_ONLY = ("corrupted_delta_file", "disk_full")
BOUNDS = {"open_files": 64, "dev_shm_mb": 64.0, "driver_rss_mb": 600.0, "registered_mb": 64.0}
"""How far above their value after the warm-up steps each resource may go."""


def build_parser():
    parser = tiny_grpo.build_parser()
    parser.set_defaults(steps=30, rollout_num_gpus=2, check_weight_update_equal=True, use_fault_tolerance=True,
                        ft_components="rollout,train", rollout_health_check_interval=0.5,
                        rollout_health_check_timeout=10.0, save_interval=3, n_samples_per_prompt=2,
                        rollout_max_response_len=8)
    g = parser.add_argument_group("chaos soak")
    g.add_argument("--faults", type=int, default=6, help="faults injected over the run (at most one per step)")
    g.add_argument("--fault-seed", type=int, default=0)
    g.add_argument("--warmup-steps", type=int, default=3, help="steps before the first fault (resources settle)")
    g.add_argument("--timeout", type=float, default=20.0, help="the job's timeout_s (a stalled engine waits it out)")
    g.add_argument("--max-restarts", type=int, default=None,
                   help="repairs of one kind allowed per hour (FaultToleranceConfig.max_restarts, default 8): a "
                        "schedule denser than a real run's faults needs more")
    g.add_argument("--json", type=str, default=None, help="write the table and every step's checks here")
    return parser


def schedule(kinds: tuple[str, ...], steps: int, faults: int, warmup: int, seed: int) -> dict[int, str]:
    """Step -> fault kind: ``faults`` distinct steps after the warm-up (the last step left clean), kinds in a
    seeded order cycling through all of them so each appears before any repeats."""
    rng = random.Random(seed)
    candidates = list(range(warmup, steps - 1))
    if faults > len(candidates):
        raise SystemExit(f"chaos_soak: {faults} faults need at least {faults + warmup + 1} steps (--steps)")
    chosen = sorted(rng.sample(candidates, faults))
    order = list(kinds)
    rng.shuffle(order)
    return {step: order[i % len(order)] for i, step in enumerate(chosen)}


# ---- resources ----------------------------------------------------------------------------------

def actor_processes() -> list[str]:
    """Processes descending from this driver (its local Ray) that run a Ray actor (``ray::Class`` in their
    command line; idle workers and Ray's own agents not counted): a killed actor whose process lingers, or a restart that left
    two, shows here."""
    parent, command = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        parent[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    me = os.getpid()

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == me:
                return True
        return False

    return sorted(cmd.decode(errors="replace") for pid, cmd in command.items()
                  if cmd.startswith(b"ray::") and not cmd.startswith(b"ray::IDLE") and not cmd.endswith(b"Agent")
                  and ours(pid))


def registered_mb(trainer) -> float:
    """MB the trainer's p2p sender has registered with Mooncake (what a peer could reach); 0 in other modes."""
    import ray

    def read(worker) -> float:
        engine = getattr(getattr(worker, "transfer_sender", None), "_engine", None)
        return sum(t.numel() * t.element_size() for t in getattr(engine, "registered", {}).values()) / 1e6

    return ray.get(trainer.__ray_call__.remote(read), timeout=30)


def resources(trainer) -> dict[str, float]:
    shm = [e for e in os.scandir("/dev/shm") if e.is_file(follow_symlinks=False)] if os.path.isdir("/dev/shm") else []
    return {"open_files": len(os.listdir("/proc/self/fd")),
            "dev_shm_mb": sum(e.stat(follow_symlinks=False).st_size for e in shm) / 1e6,
            "live_actors": len(actors := actor_processes()), "actor_processes": actors,
            "driver_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
            "registered_mb": registered_mb(trainer)}


# ---- faults -------------------------------------------------------------------------------------

def actor_pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def kill(actor, pid: int | None = None) -> None:
    """Kill the actor's process and return once it is gone: ``ray.kill`` only asks, and an actor that has
    not died yet may still answer the update the fault is meant to hit."""
    import ray

    pid = actor_pid(actor) if pid is None else pid
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class DiskFiller:
    """A tmpfs mounted as the disk-delta folder, filled on request and freed again."""

    def __init__(self, folder: Path, size_mb: int):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        self.mounted = done.returncode == 0
        self.why_not = done.stderr.strip()
        self.filler = folder / "filler.bin"

    def fill(self) -> None:
        """Fill the filesystem to its last byte: the next version cannot be written however small (late in
        a run an xor delta is nearly empty), nor, unless the failed write freed some, the abort marker."""
        chunk = b"\0" * (1 << 20)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for size in (len(chunk), 4096, 1):  # down to the last partial page
                try:
                    while os.write(fd, chunk[:size]):
                        pass
                except OSError:
                    pass
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.folder)], capture_output=True)


def corrupt_next_version(disk_dir: Path, after: int, engine_pid_to_resume: int, timeout_s: float) -> dict:
    """Start a thread that waits for a version newer than ``after`` to be published, flips a byte in its
    largest file (a shard; the index when the delta changed no tensor, as late in a converged run), then
    lets the stopped engine go on (it reads the damaged file). Returns the thread's record: ``file`` once
    corrupted, ``error`` if it could not be."""
    from rlplacement.transfer.disk_delta import folder_format

    record: dict = {}

    def run() -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                pointer = folder_format.read_pointer(disk_dir)
                if pointer and int(pointer["version"]) > after:
                    folder = disk_dir / pointer["folder"]
                    target = max(folder.iterdir(), key=lambda p: p.stat().st_size)
                    data = bytearray(target.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    target.write_bytes(bytes(data))
                    record["file"] = target.name
                    return
                time.sleep(0.01)
            record["error"] = f"no version after {after} was published within {timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - reported by the soak as a fault not injected
            record["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                os.kill(engine_pid_to_resume, signal.SIGCONT)
            except ProcessLookupError:  # replaced meanwhile (a stopped engine misses its health checks)
                pass

    record["thread"] = threading.Thread(target=run, daemon=True)
    record["thread"].start()
    return record


# ---- checks -------------------------------------------------------------------------------------

class Violation(AssertionError):
    pass


def check_step(job, samples_versions: set[int], served_at_generate: int, last: dict) -> dict:
    import ray

    served = job.served_versions()
    if job.stale is not None or any(v != job.version for v in served):
        raise Violation(f"engines serve {served}, the job {job.version} (stale: {job.stale})")
    from rlplacement.transfer.shards import parse_region_key

    got = ray.get([e.received_checksums.remote() for e in job.engines], timeout=120)
    keys = sorted({key for sums in got for key in sums})  # workers that keep slices hold name[box] keys
    want = ray.get([t.hf_checksums.remote(keys) for t in job.trainers], timeout=120)[0]  # collective
    names = set(ray.get([t.hf_checksums.remote() for t in job.trainers], timeout=120)[0])
    covered = {parse_region_key(key)[0] for key in keys}
    if covered != names:
        raise Violation(f"engines hold no bytes of {sorted(names - covered)[:3]} or of tensors the trainer does "
                        f"not have {sorted(covered - names)[:3]}")
    for i, sums in enumerate(got):
        if sums != want:
            bad = next(n for n in want if sums.get(n) != want[n])
            raise Violation(f"engine {i} holds other bytes than the trainer's for {bad}")
    if samples_versions != {served_at_generate}:
        raise Violation(f"samples from versions {sorted(samples_versions)}, the engines served {served_at_generate}")
    if job.version < last["version"]:
        raise Violation(f"the version went back from {last['version']} to {job.version}")
    restarts = sum(r.kind == "trainer" for r in job.ft.recoveries)
    if job.epoch != restarts:
        raise Violation(f"epoch {job.epoch} but {restarts} recorded trainer restarts")
    last["version"] = job.version
    return {"version": job.version, "epoch": job.epoch}


def check_resources(now: dict, base: dict, expected_actors: int) -> None:
    if now["live_actors"] != expected_actors:
        raise Violation(f"{now['live_actors']} live Ray actors, expected {expected_actors} (a leaked or lost process): "
                        f"{', '.join(now['actor_processes'])}")
    for key, bound in BOUNDS.items():
        if now[key] > base[key] + bound:
            raise Violation(f"{key} {now[key]:.1f} grew past {base[key]:.1f} + {bound}")


# ---- the run ------------------------------------------------------------------------------------

def run(args) -> dict:
    import ray
    from transformers import AutoTokenizer

    import rlplacement
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="chaos_soak_"))
    if not args.save:
        args.save = str(work / "save")
        Path(args.save).mkdir(parents=True, exist_ok=True)
    disk = None
    kinds = ALWAYS
    if args.update_weight_transfer_mode == "disk-delta":
        kinds = ALWAYS + ("corrupted_delta_file",)
        disk_dir = Path(args.update_weight_disk_dir or work / "deltas")
        disk = DiskFiller(disk_dir, size_mb=64)
        if disk.mounted:
            kinds += ("disk_full",)
        else:
            print(f"chaos_soak: disk_full not injected: no tmpfs could be mounted ({disk.why_not})", file=sys.stderr)
        args.update_weight_disk_dir = str(disk_dir)
    plan = schedule(kinds, args.steps, args.faults, args.warmup_steps, args.fault_seed)
    config = rlplacement.config_from_args(args)
    if args.max_restarts is not None:
        config = dataclasses.replace(config, fault_tolerance=dataclasses.replace(config.fault_tolerance,
                                                                                 max_restarts=args.max_restarts))
    hf_dir = str(make_tiny_model(work / "model", TinySpec(**tiny_grpo.TINY_MODEL, dtype=tiny_grpo.tiny_model_dtype())))
    tok = AutoTokenizer.from_pretrained(hf_dir)
    targets = {tok.convert_tokens_to_ids(d) for d in tiny_grpo.DIGITS}
    prompts = [tok.encode(p) for p in tiny_grpo.PROMPTS]
    group = config.rollout.n_samples_per_prompt
    rows, faults = [], []
    t_start = time.monotonic()
    expected_actors = None
    base = None
    last = {"version": 0}
    try:
        with rlplacement.RLJob.start(config, hf_dir, timeout_s=args.timeout) as job:
            expected_actors = len(job.trainers) + len(job.engines)
            for step in range(args.steps):
                kind = plan.get(step)
                t_fault = time.monotonic()
                lost_before = sum(r.steps_lost for r in job.ft.recoveries)
                chosen = [prompts[(step * args.prompts_per_step + i) % len(prompts)]
                          for i in range(args.prompts_per_step)]
                samples = job.generate(chosen)
                served_at_generate = job.version
                rewards = [sum(int(t) in targets for t in s.token_ids) / max(len(s.token_ids), 1) for s in samples]
                batch = tiny_grpo.make_batch(samples, rewards, group, tok.pad_token_id or 0)
                if kind == "trainer_killed":
                    kill(job.trainers[0])
                job.train(batch)
                victim = job.engines[step % len(job.engines)]
                if kind == "engine_killed_before_update":
                    kill(victim)
                elif kind == "engine_killed_during_update":
                    pid = actor_pid(victim)
                    ray.get(job.trainers[0].inject_update_fault.remote(1, stall_s=3.0))
                    threading.Timer(1.0, kill, (victim, pid)).start()
                elif kind == "receiver_stalled":
                    pid = actor_pid(victim)
                    ray.get(job.trainers[0].inject_update_fault.remote(1, stall_s=1.0))
                    threading.Timer(0.3, os.kill, (pid, signal.SIGSTOP)).start()
                elif kind == "corrupted_delta_file":
                    pid = actor_pid(victim)
                    os.kill(pid, signal.SIGSTOP)
                    corruption = corrupt_next_version(Path(args.update_weight_disk_dir), job.issued, pid, args.timeout)
                elif kind == "disk_full":
                    disk.fill()
                try:
                    job.update_weights()
                except rlplacement.TransferError as exc:
                    if kind != "disk_full":
                        raise
                    print(f"step {step}: disk full, update refused: {str(exc)[:160]}", file=sys.stderr)
                else:
                    if kind == "disk_full":
                        raise Violation(f"step {step}: the update succeeded on a full disk")
                finally:
                    if kind == "disk_full":
                        disk.free()  # the operator frees space; the next rollout reconciles
                if kind == "corrupted_delta_file":
                    corruption["thread"].join(args.timeout)
                    if "file" not in corruption:
                        raise Violation(f"step {step}: no delta file was corrupted: {corruption.get('error')}")
                if kind == "engine_killed_after_update":
                    kill(victim)
                if kind in ("engine_killed_after_update", "disk_full"):  # what the next rollout repairs
                    # a health check is due again (as at a real run's next rollout); a dead engine the
                    # next rollout happened not to use would otherwise wait for a later one
                    time.sleep(config.fault_tolerance.health_check_interval_s)
                    samples_next = job.generate(chosen[:1])
                    served_at_generate = job.version
                    samples = samples_next
                checks = check_step(job, {s.weight_version for s in samples}, served_at_generate, last)
                now = resources(job.trainers[0])
                if step == args.warmup_steps - 1:
                    base = now
                if base is not None:
                    check_resources(now, base, expected_actors)
                metrics = job.pop_ft_metrics()
                row = {"step": step, "fault": kind, "step_s": round(time.monotonic() - t_fault, 3), **checks, **now,
                       **metrics}
                rows.append(row)
                if kind is not None:
                    faults.append({"kind": kind, "step": step, "recovered": True,
                                   "seconds": time.monotonic() - t_fault,
                                   "steps_lost": sum(r.steps_lost for r in job.ft.recoveries) - lost_before})
                sys.stdout.write(f"step {step}: v{job.version} epoch {job.epoch}"
                                 + (f"  fault {kind} recovered in {faults[-1]['seconds']:.1f}s" if kind else "")
                                 + f"  reward {statistics.fmean(rewards):.3f}\n")
                sys.stdout.flush()
    finally:
        if disk is not None:
            disk.close()
    quiet = [r["step_s"] for r in rows if r["fault"] is None]
    return {"faults": faults, "rows": rows, "table": table(faults, plan),
            "median_step_s_without_fault": round(statistics.median(quiet), 3) if quiet else None,
            "wall_s": round(time.monotonic() - t_start, 1)}


def table(faults: list[dict], plan: dict[int, str]) -> list[dict]:
    out = []
    for kind in sorted(set(plan.values())):
        done = [f for f in faults if f["kind"] == kind]
        out.append({"kind": kind, "injected": sum(k == kind for k in plan.values()),
                    "recovered": sum(f["recovered"] for f in done),
                    "seconds_to_recover": round(statistics.fmean(f["seconds"] for f in done), 2) if done else None,
                    "max_seconds_to_recover": round(max(f["seconds"] for f in done), 2) if done else None,
                    "steps_lost": sum(f["steps_lost"] for f in done)})
    return out


def write_result(path: str, argv: list[str], result: dict) -> None:
    """The soak's results file, whole: the run's commit, date, machine and command, its arguments, ``result``."""
    facts = run_facts("python benchmarks/chaos_soak.py", argv, env=("MC_LOG_LEVEL",))
    Path(path).write_text(json.dumps({**facts, "argv": argv, **result}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except Violation as exc:
        print(f"chaos_soak: invariant violated: {exc}", file=sys.stderr)
        return 1
    print(f"{'fault':32s} {'injected':>8s} {'recovered':>9s} {'s to recover':>12s} {'steps lost':>10s}")
    for r in result["table"]:
        secs = "-" if r["seconds_to_recover"] is None else f"{r['seconds_to_recover']:.1f}"
        print(f"{r['kind']:32s} {r['injected']:8d} {r['recovered']:9d} {secs:>12s} {r['steps_lost']:10d}")
    if args.json:
        write_result(args.json, list(argv if argv is not None else sys.argv[1:]), result)
    return 0 if all(r["recovered"] == r["injected"] for r in result["table"]) else 1


if __name__ == "__main__":
    sys.exit(main())
