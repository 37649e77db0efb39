"""Nothing left behind and no wait without a bound: cuda_ipc's /dev/shm files of a killed trainer are
swept by the next sender (never a live process's), the engine's stepper and the Miles adapter's queue
give up by name after their bound. Real processes and files; the requests that never finish are a
fake ("FakeStuckEngine"), since a vLLM step that hangs cannot be made on purpose."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rlplacement.transfer.cuda_ipc.buckets import SharedSlots, leftover_shm_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLD_A_BUFFER = """
import sys, time
from rlplacement.transfer.cuda_ipc.buckets import SharedSlots
slots = SharedSlots("cpu", min_nbytes=4096)
_, desc = slots.get(0, 16)
print(desc["path"], flush=True)
time.sleep(600)
"""


def _holder():
    """A process holding one shared bucket file, and the file's path."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_A_BUFFER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    path = proc.stdout.readline().strip()
    assert path and os.path.exists(path), "the holder did not create its file"
    return proc, path


def test_a_killed_senders_files_are_swept_by_the_next_sender_and_a_live_ones_kept():
    killed, killed_path = _holder()
    live, live_path = _holder()
    try:
        killed.send_signal(signal.SIGKILL)  # mid-update: no chance to unlink
        killed.wait(timeout=30)
        assert os.path.exists(killed_path)
        assert f".{killed.pid}." in os.path.basename(killed_path)  # named with its owner
        slots = SharedSlots("cpu")  # a new sender starts
        try:
            assert os.path.basename(killed_path) in slots.swept
            assert not os.path.exists(killed_path)
            assert os.path.exists(live_path) and os.path.basename(live_path) not in slots.swept
        finally:
            slots.close()
    finally:
        live.kill()
        live.wait(timeout=30)
        for path in (killed_path, live_path):
            if os.path.exists(path):
                os.unlink(path)


def test_a_file_of_a_reused_pid_or_of_unknown_owner_is_judged_rightly(tmp_path):
    from rlplacement.transfer.cuda_ipc import buckets

    own = buckets.owner_tag()
    namespace, pid, start = own.split(".")
    assert not buckets._owner_gone(f"{buckets.SHM_PREFIX}{own}.x-0-0", namespace)  # this live process
    assert buckets._owner_gone(f"{buckets.SHM_PREFIX}{namespace}.{pid}.{int(start) + 1}.x-0-0", namespace)  # reused pid
    assert not buckets._owner_gone(f"{buckets.SHM_PREFIX}1.{pid}.{int(start) + 1}.x-0-0", namespace)  # other namespace
    assert not buckets._owner_gone(f"{buckets.SHM_PREFIX}0123456789ab-0-0", namespace)  # no owner in the name
    slots = SharedSlots("cpu")
    try:
        assert slots.tag.startswith(own + ".")
        slots.get(0, 8)
        assert len(leftover_shm_files(slots.tag)) == 1
    finally:
        slots.close()
    assert leftover_shm_files(slots.tag) == []
