"""Rollout as an RL loop uses it, on real vLLM CPU engines behind ``RLJob``: the model's own engine
defaults, the sampling flags reaching the engines, GRPO groups kept on one engine, streaming,
abort of a running generation, and requests that do not fit the context refused.

One job for the module (two one-GPU engines, an FSDP trainer) on a tiny model whose config says
bf16 and a 2048-token context; starting it dominates the module's time.
"""

import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

import rlplacement  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime.rollout_dealing import assign_groups, samples_by_engine  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 17, 9, 250]]
CONTEXT = 2048


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"),
                                TinySpec(dtype="bfloat16", max_position_embeddings=CONTEXT))
    args = rlplacement.add_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--num-gpus-per-node", "4",
         "--train-backend", "fsdp", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
         "--check-weight-update-equal"])
    with rlplacement.RLJob.start(rlplacement.config_from_args(args), str(model_dir), timeout_s=300) as started:
        started.model_dir = model_dir
        yield started


def test_engines_take_dtype_and_context_from_the_models_config(job):
    for info in job.engine_info:
        assert info["dtype"] == "bfloat16" and info["max_model_len"] == CONTEXT
        assert info["prefix_caching"] is True
        assert info["enforce_eager"] is True  # CPU engines always run eager (no CUDA graphs to capture)
    # the trainer (fp32 on CPU) streams its weights cast to the engines' bf16: the update checks bit for bit
    result = job.update_weights()
    assert result.version == 1 and [e.version for e in result.engines] == [1, 1]


def test_a_request_over_the_context_is_refused_naming_both_numbers(job):
    long_prompt = list(range(3, 3 + 2000))
    with pytest.raises(rlplacement.ContextLengthError, match=r"2000 tokens plus max_tokens 100 .*context of 2048"):
        job.generate([long_prompt], {"max_tokens": 100}, n_samples_per_prompt=1)
    # the engine refuses it too when called directly, before starting any request
    with pytest.raises(ray.exceptions.RayTaskError, match=r"2000 tokens plus max_tokens 100"):
        ray.get(job.engines[0].submit.remote([long_prompt], [{"max_tokens": 100}]))


def test_every_group_of_n_samples_runs_on_one_engine(job):
    samples = job.generate(PROMPTS)  # --n-samples-per-prompt 4
    assert len(samples) == 4 * len(PROMPTS)
    assert [s.index for s in samples] == list(range(12))
    for p, prompt in enumerate(PROMPTS):
        group = samples[4 * p:4 * p + 4]
        assert all(s.prompt_ids == prompt for s in group)
        assert len({s.engine for s in group}) == 1, [s.engine for s in group]
    assert {s.engine for s in samples} == {0, 1}  # three groups over two engines: both used
    assert all(len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids) for s in samples)
    # seeded per sample: the four samples of a group differ, and the same call repeats exactly
    again = job.generate(PROMPTS, seed=samples[0].index + 7)
    twice = job.generate(PROMPTS, seed=samples[0].index + 7)
    assert [s.token_ids.tolist() for s in again] == [s.token_ids.tolist() for s in twice]


def test_groups_are_balanced_by_tokens_not_by_count():
    # one long group and three short ones over two engines: the long one alone on an engine
    assert assign_groups([1000, 10, 10, 10], 2) == [0, 1, 1, 1]
    prompts = [[1] * 100] * 2 + [[2] * 5] * 2 + [[3] * 5] * 2
    shares = samples_by_engine(prompts, [10] * 6, 2)
    assert shares == [[0, 1], [2, 3, 4, 5]]


def test_top_p_and_top_k_reach_the_engine(job):
    greedy = job.generate(PROMPTS, {"temperature": 0.0}, n_samples_per_prompt=1)
    sampled = job.generate(PROMPTS, {"temperature": 1.0}, n_samples_per_prompt=1, seed=3)
    assert any(g.token_ids.tolist() != s.token_ids.tolist() for g, s in zip(greedy, sampled))
    for only_the_likeliest in ({"top_p": 1e-6}, {"top_k": 1}):
        narrowed = job.generate(PROMPTS, {"temperature": 1.0, **only_the_likeliest}, n_samples_per_prompt=1, seed=3)
        assert [s.token_ids.tolist() for s in narrowed] == [g.token_ids.tolist() for g in greedy], only_the_likeliest


def test_a_stop_string_ends_the_sample_there(job):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(job.model_dir))
    greedy = job.generate(PROMPTS[:1], {"temperature": 0.0, "max_tokens": 16}, n_samples_per_prompt=1)[0]
    words = [tok.decode([t]) for t in greedy.token_ids.tolist()]
    k = next(i for i in range(1, len(words)) if words[i].strip() and words[i].strip() not in "".join(words[:i]))
    stop = words[k].strip()
    cut = job.generate(PROMPTS[:1], {"temperature": 0.0, "max_tokens": 16, "stop": [stop]}, n_samples_per_prompt=1)[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids.tolist() == greedy.token_ids.tolist()[:len(cut.token_ids)]
    assert len(cut.token_ids) == k + 1 and stop in tok.decode(cut.token_ids.tolist())
    # the same through the flag's default
    assert job.sampling_defaults()["stop"] is None


def test_abort_returns_partial_samples_and_the_next_generate_works(job):
    pending = job.generate_async(PROMPTS[:2], {"max_tokens": 2000, "min_tokens": 2000}, n_samples_per_prompt=8)
    time.sleep(0.3)  # 8 x 2000 tokens on each engine take ~1 s on this tiny model
    partial = job.abort(pending)
    assert len(partial) == 16 and all(s.aborted and s.finish_reason == "abort" for s in partial)
    assert all(0 < len(s.token_ids) < 2000 and len(s.logprobs) == len(s.token_ids) for s in partial), \
        [(len(s.token_ids), len(s.logprobs)) for s in partial]
    assert job.collect(pending) == []  # aborted samples are not handed to training unless asked
    assert len(job.collect(pending, include_aborted=True)) == 16
    after = job.generate(PROMPTS, {"max_tokens": 4}, n_samples_per_prompt=1)
    assert [len(s.token_ids) for s in after] == [4, 4, 4] and not any(s.aborted for s in after)
    assert {s.weight_version for s in after} == {job.version}


def test_abort_reaches_a_blocking_generate_call(job):
    """The engine's blocking ``generate`` holds the actor's call slot; abort runs in its control group."""
    engine = job.engines[0]
    ref = engine.generate.remote([PROMPTS[0]] * 16, max_tokens=2000, exact_lengths=True)
    deadline = time.monotonic() + 60
    while not ray.get(engine.current_call.remote(), timeout=30).startswith("generate"):
        assert time.monotonic() < deadline, "the engine never started the generate call"
        time.sleep(0.01)
    time.sleep(0.1)  # 16 x 2000 tokens take ~1 s on this tiny model
    assert ray.get(engine.abort.remote(), timeout=30) == 16
    outs = ray.get(ref, timeout=60)
    assert all(o["aborted"] and 0 < len(o["token_ids"]) < 2000 for o in outs), [len(o["token_ids"]) for o in outs]


def test_stream_hands_samples_back_as_each_finishes(job):
    lengths = [2, 2, 2, 600]  # one straggler: the short ones come out long before it ends
    pending = job.generate_async([PROMPTS[0]], n_samples_per_prompt=4, max_tokens=lengths, exact_lengths=True)
    seen, times = [], []
    for sample in job.stream(pending):
        seen.append(sample.index)
        times.append(time.monotonic())
    assert sorted(seen) == [0, 1, 2, 3] and seen[-1] == 3
    assert times[-1] - times[0] > 0.2  # the first three were handed over before the straggler finished
    assert [len(s.token_ids) for s in job.collect(pending)] == lengths


def test_an_update_waits_for_the_running_batch(job):
    """Issued while a batch generates, the update lands after it: every sample has one version."""
    before = job.version
    pending = job.generate_async([PROMPTS[1]], {"max_tokens": 300, "min_tokens": 300}, n_samples_per_prompt=2)
    done = threading.Event()
    threading.Thread(target=lambda: (job.update_weights(), done.set()), daemon=True).start()
    samples = job.collect(pending)
    assert {s.weight_version for s in samples} == {before}
    assert done.wait(120) and job.version == before + 1
    assert {s.weight_version for s in job.generate([PROMPTS[1]], {"max_tokens": 2})} == {before + 1}
