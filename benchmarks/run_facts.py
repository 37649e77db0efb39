"""What a results file says of its run, written by the script that ran it (never added by hand): the commit,
the date, the machine and the command line."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMIT_ENV = "RLPLACEMENT_COMMIT"
"""The commit the tree was at, given by the machine that sent it where the run's own checkout cannot say (the
lent GPU machine's copy carries the last landed commit's git metadata under this session's tree)."""


def run_facts(script: str, argv: list[str], env: tuple[str, ...] = ()) -> dict:
    """``commit`` (``RLPLACEMENT_COMMIT`` where set, else HEAD, ``+dirty`` with uncommitted changes to tracked
    files), ``date`` (UTC), ``machine`` (cores, memory, GPUs) and ``command``: the variables of ``env`` that are set, ``script`` and ``argv``."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = os.environ.get(COMMIT_ENV) or git("rev-parse", "--short", "HEAD")
    if COMMIT_ENV not in os.environ and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    try:
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        gpus = []
    machine = (f"{os.cpu_count()} CPU cores, {memory_gb:.0f} GB, {platform.machine()}; "
               + (f"GPUs: {', '.join(gpus)}" if gpus else "no GPU"))
    given_env = [f"{name}={os.environ[name]}" for name in env if name in os.environ]
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "machine": machine, "command": " ".join([*given_env, script, *argv])}
