"""One Ray cluster per test process, which every test that needs Ray joins instead of starting and stopping Ray
of its own (~6 s to start, ~3 s to stop and ~8 CPU-seconds of Ray's daemons each time): the example loops in
their own processes (``RAY_ADDRESS``, as a loop joins a cluster in production) and the tests' in-process drivers
(:func:`join`; their jobs' actors end with the job, or with the driver when it disconnects).

Its temp folder is its own (``ray start --temp-dir``): Ray records the address there, not where
``ray.init()`` without an address looks, and no other test's cluster is touched when it stops. Logical GPUs
as a loop's own cluster has (8 on one node); every loop releases its placement group and actors when it
ends, and one killed mid-run has them released by Ray when its driver goes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

NUM_GPUS = 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_cluster: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address() -> str:
    """The shared cluster's address, started on first use."""
    if "address" not in _cluster:
        temp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths live under it
        port = _free_port()
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        proc = subprocess.run([ray_cli, "start", "--head", "--port", str(port), "--num-gpus", str(NUM_GPUS),
                               "--num-cpus", str(os.cpu_count()), "--temp-dir", temp, "--include-dashboard=false",
                               "--disable-usage-stats"], capture_output=True, text=True, timeout=180,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        if proc.returncode:
            raise RuntimeError(f"ray start failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        _cluster.update(address=f"127.0.0.1:{port}", temp=temp)
    return _cluster["address"]


def join(runtime_env: dict | None = None) -> None:
    """This process's driver joined to the shared cluster (a no-op when it is connected already): the workers
    of its actors get ``runtime_env``. The cluster's workers inherit the environment of the process that
    started it, not of this one at the time it joins: give what they need in ``runtime_env``."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address(), log_to_driver=False, **({"runtime_env": runtime_env} if runtime_env else {}))


def stop() -> None:
    """End the shared cluster's processes (found by its temp folder in their command lines), if it ran."""
    temp = _cluster.pop("temp", None)
    _cluster.pop("address", None)
    if temp is None:
        return
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if temp.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(2 if sig == signal.SIGTERM else 0)
    shutil.rmtree(temp, ignore_errors=True)
