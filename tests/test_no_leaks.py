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

from rlplacement.errors import EngineStuckError
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


def shm_mapped_by(pid: int) -> set[str]:
    """Names of the /dev/shm files (still linked) that process ``pid`` or any of its descendants maps."""
    pids, names = [pid], set()
    for p in pids:  # grows while walked: children of children
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    pids += [int(c) for c in f.read().split()]
            with open(f"/proc/{p}/maps") as f:
                names |= {line.split("/dev/shm/", 1)[1].strip() for line in f
                          if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}
        except OSError:  # the process ended meanwhile
            continue
    return names


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


class FakeStuckEngine:
    """Stands in for ``vllm.LLM`` (and its ``llm_engine``) whose requests never finish: each step returns
    no output (``step_blocks``: a step never returns, as when a worker stopped answering)."""

    def __init__(self, step_blocks: bool = False):
        self.llm_engine = self
        self.step_blocks = step_blocks
        self.unblock = threading.Event()

    def enqueue(self, prompts, params, use_tqdm=False):
        return [f"fake{i}-abcdefgh" for i in range(len(prompts))]

    def has_unfinished_requests(self):
        return True

    def step(self):
        if self.step_blocks:
            self.unblock.wait()
        time.sleep(0.01)
        return []

    def abort_request(self, ids, internal=False):
        pass


def _stepper(step_blocks: bool, timeout_s: float = 0.5):
    from vllm import SamplingParams

    from rlplacement.engines.vllm.request_stepper import RequestStepper

    fake = FakeStuckEngine(step_blocks)
    stepper = RequestStepper(fake, name="engine 3", timeout_s=timeout_s)
    batch = stepper.submit([[1, 2]], [SamplingParams(max_tokens=4)], version=1)
    return fake, stepper, batch


def test_a_wait_for_generation_to_go_idle_is_bounded_and_named():
    fake, stepper, batch = _stepper(step_blocks=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"engine 3: 1 request\(s\) still in flight after 0.5 s of waiting for "
                                           r"generation to finish before weight update 7; abort\(\) them, or raise "
                                           r"the bound: the bound is the engine's timeout_s=0.5"):
        stepper.wait_idle(before="weight update 7")
    assert time.monotonic() - start < 3
    assert stepper.abort() == 1  # the engine stays usable: the request ends, the wait returns
    stepper.wait_idle()


def test_a_step_that_never_returns_fails_poll_and_calls_by_name():
    fake, stepper, batch = _stepper(step_blocks=True)
    start = time.monotonic()
    with pytest.raises(EngineStuckError, match="engine 3: no generation step finished within 0.5 s with 1 request"):
        while True:  # a caller polling in short slices, as generate() and the driver do
            stepper.poll(batch, 0.2)
    assert time.monotonic() - start < 3
    with pytest.raises(EngineStuckError, match=r"engine 3: worker call rlplacement_stage waited 0.5 s for the engine, "
                                           r"held all that time by a generation step that did not end"):
        stepper.call(lambda: None, "worker call rlplacement_stage")
    fake.unblock.set()


def test_a_call_that_never_returns_is_bounded_and_the_engine_refuses_by_name_until_it_returns():
    from rlplacement.engines.vllm.request_stepper import RequestStepper

    stepper = RequestStepper(FakeStuckEngine(), name="engine 4", timeout_s=0.5)
    assert stepper.call(lambda: 42, "a quick call") == 42
    with pytest.raises(ValueError, match="raised inside"):  # a call's own error comes back as itself
        stepper.call(lambda: (_ for _ in ()).throw(ValueError("raised inside")), "a failing call")
    release = threading.Event()
    with pytest.raises(EngineStuckError, match=r"engine 4: worker call rlplacement_commit did not return within 0.5 s"):
        stepper.call(release.wait, "worker call rlplacement_commit")
    with pytest.raises(EngineStuckError, match="engine 4 cannot take reset_prefix_cache: worker call rlplacement_commit "
                                           "did not return and still holds the engine; restart the engine"):
        stepper.call(lambda: None, "reset_prefix_cache")
    release.set()  # the abandoned call returns at last: the engine takes calls again
    deadline = time.monotonic() + 5
    while stepper._stuck is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stepper.call(lambda: 7, "a call after it") == 7
    assert stepper.call(lambda: 8, "a longer call", bound_s=2.0) == 8


def test_the_miles_adapters_queue_waits_are_bounded():
    import torch

    from rlplacement.integrations.miles import _StreamedUpdate
    from rlplacement.transfer.base import WeightUpdateError

    class FakeSender:
        """Takes every tensor Miles pushes, as our sender's ``update`` does."""

        def update(self, version, tensors):
            return sum(1 for _ in tensors)

    update = _StreamedUpdate(FakeSender(), 5, {}, timeout_s=0.5)
    update.put([("w", torch.zeros(2))])  # then Miles stops pushing: no send_bucket, no after_base_weights
    update._thread.join(timeout=5)
    assert not update._thread.is_alive()
    with pytest.raises(WeightUpdateError, match=r"trainer.*version 5: Miles pushed no bucket for 0.5 s \(neither "
                                                r"send_bucket nor after_base_weights was called\)"):
        update.result([], check_equal=False)
    with pytest.raises(Exception, match="the sender took no bucket for 0.5 s"):  # and the producer's side
        for _ in range(4):
            update.put([("w", torch.zeros(2))])


def test_the_update_graphs_teardown_is_bounded_and_named():
    from rlplacement.runtime.update_graph import CompiledUpdate

    class FakeStuckGraph:
        """Stands in for a compiled graph whose teardown never ends (an actor's loop stuck in an update)."""

        def __init__(self):
            self.release = threading.Event()

        def teardown(self):
            self.release.wait()

    graph = CompiledUpdate.__new__(CompiledUpdate)  # its state without compiling a graph of real actors
    graph._graph, graph._teardown, graph.broken = FakeStuckGraph(), None, None
    graph.timeout_s, graph.names = 0.5, ["trainer", "engine 0"]
    stuck = graph._graph
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"update graph's teardown did not end within 0.5 s: the update loop of one "
                                           r"of trainer, engine 0 did not stop"):
        graph.close()
    assert time.monotonic() - start < 3 and graph.broken == "closed"
    stuck.release.set()
    graph.close()  # the teardown ended: closing again returns
