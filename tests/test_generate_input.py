"""``RLJob.generate`` takes text prompts (the model's tokenizer makes the ids) as well as token ids, and a
sampling key the engines do not take is refused naming the nearest one, before any request starts."""

import pytest

from rlplacement.job import rollout
from rlplacement.engines.registry import engine_class
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("hf") / "model"))


def test_text_prompts_become_the_models_token_ids_and_ids_stay_as_they_are(tokenizer):
    ids = rollout.prompt_ids(["hello world", [5, 6, 7]], tokenizer.encode)
    assert ids == [tokenizer.encode("hello world"), [5, 6, 7]] and all(isinstance(t, int) for t in ids[0])
    assert ids[0]  # the tokenizer made tokens of it


@pytest.mark.parametrize("prompt", [3.5, [1, "x"], None])
def test_a_prompt_that_is_neither_text_nor_ids_is_named(tokenizer, prompt):
    with pytest.raises(ConfigError, match=r"prompt 1 is .*: give each prompt as text \(a str, tokenized with the "
                                          r"model's tokenizer\) or as token ids \(a list of ints\)"):
        rollout.prompt_ids([[1, 2], prompt], tokenizer.encode)


def test_a_misspelled_sampling_key_is_named_with_the_nearest_one():
    vllm_keys = engine_class("vllm").sampling_keys
    with pytest.raises(ConfigError, match=r"sampling key 'max_token' is not one the engines take: did you mean "
                                          r"'max_tokens'\?"):
        rollout.check_sampling_keys({"max_token": 4}, vllm_keys)
    with pytest.raises(ConfigError, match=r"sampling key 'repetiton_penalty' .* did you mean 'repetition_penalty'"):
        rollout.check_sampling_keys({"repetiton_penalty": 1.1}, vllm_keys)
    rollout.check_sampling_keys({"max_tokens": 4, "repetition_penalty": 1.1, "min_p": 0.05}, vllm_keys)  # vLLM's own


def test_the_common_keys_need_no_engine_library():
    def never() -> frozenset:
        raise AssertionError("asked for the engine's keys although every key is a common one")

    rollout.check_sampling_keys({"max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 1}, never)
