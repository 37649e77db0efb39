"""The stepper's stall bound (``engines.vllm.request_stepper``), driven through a stand-in for vLLM's engine (its
step can be held at will, which a real engine's cannot): a generation step that does not end within the
bound is named; a control call that holds the engine longer than the bound is not charged to generation."""

import threading
import time
import types

import pytest

pytest.importorskip("vllm")

from rlplacement.engines.vllm.request_stepper import RequestStepper  # noqa: E402
from rlplacement.errors import EngineStuckError  # noqa: E402


class StandInEngine:
    """What the stepper calls on ``vllm.LLM.llm_engine``: each step finishes every request in flight, once
    ``step_allowed`` is set."""

    def __init__(self):
        self.requests: list[str] = []
        self.step_allowed = threading.Event()
        self.step_allowed.set()

    def add_request(self, request_id, prompt, params):
        self.requests.append(request_id)
        return request_id

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.step_allowed.wait()
        done, self.requests = self.requests, []
        return [types.SimpleNamespace(request_id=r, finished=True, outputs=[types.SimpleNamespace(
            token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None)]) for r in done]

    def abort_request(self, ids, internal=False):
        self.requests = [r for r in self.requests if r not in ids]


@pytest.fixture
def stepper(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    engine = StandInEngine()
    return RequestStepper(types.SimpleNamespace(llm_engine=engine), name="engine 0", timeout_s=0.5), engine


def test_a_call_holding_the_engine_past_the_bound_is_not_a_stalled_generation_with_a_stand_in_engine(stepper):
    stepper, engine = stepper
    held = threading.Event()
    release = threading.Event()

    def long_call():
        held.set()
        release.wait(5)
        return "done"

    stepper.pause()  # the request is in flight, unstepped, when the call takes the engine
    batch = stepper.submit([[1, 2]], [types.SimpleNamespace()], version=3)
    result = {}
    caller = threading.Thread(target=lambda: result.update(value=stepper.call(long_call, "a long call", bound_s=5)))
    caller.start()
    assert held.wait(5)
    stepper.resume()
    threading.Timer(1.5, release.set).start()  # three times the stall bound
    samples, done = [], False
    while not done:
        new, done = stepper.poll(batch, 5)
        samples += new
    caller.join(5)
    assert result == {"value": "done"}
    assert done and [s["token_ids"].tolist() for s in samples] == [[7]] and samples[0]["weight_version"] == 3


def test_a_generation_step_that_does_not_end_is_named_after_the_bound_with_a_stand_in_engine(stepper):
    stepper, engine = stepper
    engine.step_allowed.clear()
    batch = stepper.submit([[1, 2]], [types.SimpleNamespace()], version=1)
    start = time.monotonic()
    with pytest.raises(EngineStuckError, match=r"engine 0: no generation step finished within 0.5 s with 1 "
                                               r"request\(s\) in flight"):
        stepper.poll(batch, 5)
    assert 0.4 < time.monotonic() - start < 3
    engine.step_allowed.set()
