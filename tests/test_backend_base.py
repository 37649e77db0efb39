"""The backend interface's own guards and the GRPO loss, without any framework."""

import pytest
import torch

from rlplacement.errors import ConfigError
from rlplacement.backends.base import policy_gradient_loss, token_log_probs
from rlplacement.config import OptimConfig
from rlplacement.train_io import Batch


def test_batch_shapes_are_checked_with_the_field_named():
    ids = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="Batch.loss_mask shape \\(2, 4\\) must equal input_ids shape \\(2, 5\\)"):
        Batch(ids, torch.ones(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="Batch.advantages must be \\[B\\] = \\[2\\]"):
        Batch(ids, torch.ones(2, 5), torch.zeros(3))
    with pytest.raises(ValueError, match="int64"):
        Batch(ids.int(), torch.ones(2, 5), torch.zeros(2))


def test_optimizer_config_rejects_unknown_names_and_bad_lr():
    with pytest.raises(ConfigError, match="optimizer 'lion' is unknown: use adamw or sgd"):
        OptimConfig(name="lion")
    with pytest.raises(ConfigError, match="learning rate must be positive"):
        OptimConfig(lr=0.0)


def test_token_log_probs_shift_by_one_and_zero_first_position():
    logits = torch.randn(1, 4, 7)
    ids = torch.tensor([[3, 1, 6, 2]])
    lp = token_log_probs(logits, ids)
    assert lp[0, 0] == 0
    for t in range(1, 4):
        assert torch.allclose(lp[0, t], torch.log_softmax(logits[0, t - 1], -1)[ids[0, t]])


def test_policy_gradient_loss_is_the_masked_token_mean_of_advantage_times_logp():
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, -4.0]])
    batch = Batch(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([[0, 1, 1], [0, 1, 0.]]), torch.tensor([2.0, -1.0]))
    # tokens: 2*-1, 2*-2, -1*-3 -> sum -3 over 3 tokens -> loss = -(-3/3) = 1
    assert policy_gradient_loss(logp, batch).item() == pytest.approx(1.0)


def test_the_importance_ratio_is_one_on_policy_and_clipped_when_stale():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -1.5]], requires_grad=True)
    plain = policy_gradient_loss(logp, Batch(ids, mask, adv))
    on_policy = policy_gradient_loss(logp, Batch(ids, mask, adv, logp.detach().clone()))
    g_plain, = torch.autograd.grad(plain, logp)
    g_on, = torch.autograd.grad(on_policy, logp)
    assert torch.allclose(g_on, g_plain)  # ratio 1: the same gradient as the on-policy loss
    # the current policy likes sample 0 far more than the engine that drew it (ratio e > 1.2):
    # its positive advantage is clipped, so it gives no gradient; sample 1 (ratio 1) still does
    stale = policy_gradient_loss(logp, Batch(ids, mask, adv, logp.detach() - torch.tensor([[1.0], [0.0]])))
    g_stale, = torch.autograd.grad(stale, logp)
    assert torch.all(g_stale[0] == 0) and torch.allclose(g_stale[1], g_plain[1])
