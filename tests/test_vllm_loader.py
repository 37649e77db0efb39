"""What an engine accepts as an update before anything touches its model (rlplacement.engines.vllm.vllm_loader)."""

import pytest
import torch

from rlplacement.engines.vllm.vllm_loader import validate
from rlplacement.transfer.base import TransferError

EXPECTED = {"model.embed_tokens.weight": (10, 4), "model.norm.weight": (4,), "lm_head.weight": (10, 4)}


def _staged(*names):
    return [(n, torch.zeros(EXPECTED[n])) for n in names]


def test_a_whole_update_passes_and_a_tied_head_may_be_left_out():
    validate(_staged(*EXPECTED), EXPECTED, "engine 0")
    validate(_staged("model.embed_tokens.weight", "model.norm.weight"), EXPECTED, "engine 0",
             optional=frozenset({"lm_head.weight"}))


@pytest.mark.parametrize("staged, message", [
    ([], "holds no tensors"),
    (_staged("model.embed_tokens.weight", "model.norm.weight"),
     r"engine 0: the update has no tensor 'lm_head.weight' \(2 of the engine's 3 tensors\)"),
    (_staged(*EXPECTED) + _staged("model.norm.weight"), "tensor 'model.norm.weight' was sent twice"),
    (_staged(*EXPECTED) + [("model.layers.9.foo", torch.zeros(1))], "'model.layers.9.foo' is not in the engine"),
    ([(n, torch.zeros(3)) if n == "model.norm.weight" else (n, t) for n, t in _staged(*EXPECTED)],
     r"'model.norm.weight' has shape \(3,\), the engine's checkpoint has \(4,\)"),
])
def test_bad_updates_are_refused_naming_the_tensor(staged, message):
    with pytest.raises(TransferError, match=message):
        validate(staged, EXPECTED, "engine 0")


def test_the_engine_validates_again_unless_it_is_handed_the_very_pairs_that_passed():
    """The backend skips validation only for the same (name, tensor) objects as last time (receivers
    hand over the same views while nothing moved); any other list is checked whole."""
    pytest.importorskip("vllm")
    from rlplacement.engines.vllm.vllm_backend import RlplacementWeightTransferEngine

    engine = RlplacementWeightTransferEngine.__new__(RlplacementWeightTransferEngine)  # only what _validate reads
    engine._expected, engine._tied, engine._validated, engine.receiver = EXPECTED, False, [], None
    staged = _staged(*EXPECTED)
    engine._validate(staged)
    engine._validate(list(staged))  # the same pairs in a new list: nothing to check again
    reshaped = [(n, torch.zeros(3)) if n == "model.norm.weight" else pair for n, pair in zip(EXPECTED, staged)]
    with pytest.raises(TransferError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine._validate(reshaped)
    with pytest.raises(TransferError, match="no tensor 'lm_head.weight'"):
        engine._validate(staged[:2])  # a prefix of the pairs that passed is not a pass
