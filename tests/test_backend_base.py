"""The backend interface's own guards and the GRPO loss, without any framework."""

import pytest
import torch

from rlplacement.backends.batching import fixed_micro_batches, pack_by_tokens, split_steps
from rlplacement.backends.objective import TokenStats, chunked_token_stats, kl_penalty, policy_loss, token_log_probs
from rlplacement.config import OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.train_io import Batch

ON_POLICY = TrainConfig()


def policy_gradient_loss(logp, batch, cfg=ON_POLICY):
    """The objective as one micro-batch that is the whole step: normalised by its own response tokens."""
    return policy_loss(TokenStats(logp), batch, cfg, float(batch.loss_mask.sum().clamp(min=1.0))).loss


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


def test_clip_higher_bounds_the_ratio_asymmetrically():
    ids = torch.zeros(1, 2, dtype=torch.int64)
    mask = torch.tensor([[0.0, 1.0]])
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    for ratio, bound in ((1.25, 0.2), (1.25, 0.28)):  # ratio 1.25 > 1 + 0.2, < 1 + 0.28
        old = logp.detach() - torch.tensor([[0.0, float(torch.log(torch.tensor(ratio)))]])
        cfg = TrainConfig(eps_clip=0.2, eps_clip_high=bound)
        loss = policy_gradient_loss(logp, Batch(ids, mask, torch.tensor([1.0]), old), cfg)
        g, = torch.autograd.grad(loss, logp)
        assert (g[0, 1] == 0) == (bound == 0.2)  # clipped by 1.2, not by 1.28


def test_kl_is_zero_when_policy_and_reference_agree_and_positive_otherwise():
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    for kind in ("low_var_kl", "k1", "k2"):
        assert torch.equal(kl_penalty(logp, logp.clone(), kind), torch.zeros_like(logp))
    assert bool((kl_penalty(logp, logp - 0.5, "low_var_kl")[0, 1:] > 0).all())
    assert bool((kl_penalty(logp, logp - 0.5, "k2")[0, 1:] > 0).all())
    cfg = TrainConfig(use_kl_loss=True, kl_loss_coef=0.5)
    batch = Batch(torch.zeros(1, 3, dtype=torch.int64), torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([1.0]))
    same = policy_loss(TokenStats(logp), batch, cfg, 2.0, logp.clone())
    assert same.kl == 0.0 and same.loss.item() == pytest.approx(policy_gradient_loss(logp, batch).item())


def test_learning_rate_schedule_warms_up_then_decays_to_min_lr():
    cos = OptimConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_decay_iters=10, lr_warmup_iters=2)
    assert [round(cos.lr_at(i), 4) for i in (0, 1)] == [0.5, 1.0]
    assert cos.lr_at(2) == pytest.approx(1.0) and cos.lr_at(6) == pytest.approx(0.55) and cos.lr_at(10) == 0.1
    lin = OptimConfig(lr=1.0, lr_decay_style="linear", lr_decay_iters=4)
    assert [lin.lr_at(i) for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert OptimConfig(lr=2.0).lr_at(1000) == 2.0
    with pytest.raises(ConfigError, match="--lr-decay-style cosine needs --lr-decay-iters"):
        OptimConfig(lr_decay_style="cosine")
    with pytest.raises(ConfigError, match="--min-lr 0.5 must be between 0 and --lr 0.1"):
        OptimConfig(lr=0.1, min_lr=0.5)


def test_token_packing_respects_the_budget_and_reaches_the_agreed_count():
    lengths = [10, 3, 7, 2, 9, 4]
    bins = pack_by_tokens(lengths, 20)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 20 for b in bins)
    assert len(pack_by_tokens(lengths, 20, min_count=5)) == 5  # another rank needs 5: split until equal
    with pytest.raises(ConfigError, match=r"--max-tokens-per-gpu 8 is below one sample's length \(10 tokens\)"):
        pack_by_tokens(lengths, 8)
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]] and fixed_micro_batches(3, None) == [[0, 1, 2]]
    assert split_steps(6, 3) == [range(0, 3), range(3, 6)] and split_steps(6, None) == [range(0, 6)]
    with pytest.raises(ConfigError, match="not a whole number of optimizer steps"):
        split_steps(5, 2)


class _Fp32VocabAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Every fp32 tensor an op makes whose last dimension is the vocabulary, by its rows of tokens; the
    output layer's weight transposed and its gradient (``[hidden, vocab]``) are not logits and not counted."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and tuple(t.shape) != (self.hidden, self.vocab)):
                self.rows.append(t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_log_probs_equal_unchunked_and_hold_one_chunk_of_fp32_logits(with_entropy):
    torch.manual_seed(0)
    vocab, chunk, width = 50, 4, 6
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(3, 7, width, requires_grad=True)
    ids = torch.randint(0, vocab, (3, 7))
    want = token_log_probs(head(hidden), ids, temperature=0.7)
    g_want, = torch.autograd.grad(want.sum(), hidden)
    with _Fp32VocabAllocations(vocab, width) as seen:
        got = chunked_token_stats(hidden, ids, head, temperature=0.7, chunk_tokens=chunk, with_entropy=with_entropy)
        g_got, = torch.autograd.grad(got.logp.sum() + (got.entropy.sum() * 0 if with_entropy else 0), hidden)
    torch.testing.assert_close(got.logp, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)
    assert seen.rows and max(seen.rows) <= chunk, f"fp32 [rows, vocab] tensors of {sorted(set(seen.rows))} rows"
    if with_entropy:
        p = torch.softmax(head(hidden)[:, :-1] / 0.7, -1)
        torch.testing.assert_close(got.entropy[:, 1:], -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)


def test_a_micro_batch_is_trimmed_to_its_longest_sample_and_padded_to_a_multiple():
    import torch

    from rlplacement.train_io import Batch

    ids = torch.arange(1, 15).view(2, 7)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    batch = Batch(ids, mask, torch.ones(2), torch.full((2, 7), -1.0), torch.tensor([4, 5]))
    assert batch.trimmed().input_ids.shape[1] == 5  # the longest sample
    four = batch.trimmed(4)  # sequence parallelism over 4 TP ranks: 5 -> 8 columns, past the batch's 7
    assert four.input_ids.shape[1] == 8 and torch.equal(four.input_ids[:, :7], ids)
    assert four.input_ids[:, 7].tolist() == [0, 0] and four.loss_mask[:, 7].tolist() == [0.0, 0.0]
    assert torch.equal(four.loss_mask[:, :7], mask) and four.old_logprobs[:, 7].tolist() == [0.0, 0.0]
    assert batch.trimmed(3).input_ids.shape[1] == 6 and torch.equal(batch.trimmed(3).input_ids, ids[:, :6])


def test_truncated_importance_sampling_weighs_each_token_by_the_clamped_trainer_over_engine_ratio():
    """--use-tis: the gradient equals the PPO surrogate's with each token's term times the constant
    clamp(exp(old - rollout), low, high), written out by hand here token by token."""
    torch.manual_seed(0)
    logp = torch.randn(2, 5, dtype=torch.float64).clamp(max=-0.1).requires_grad_()
    old = (logp.detach() + 0.05 * torch.randn(2, 5, dtype=torch.float64))
    rollout = old + torch.tensor([[0, 2.0, -2.0, 0.3, -0.1], [0, 0.1, 0.0, -3.0, 1.5]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    batch = Batch(torch.zeros(2, 5, dtype=torch.int64), mask, adv, old, None, None, rollout)
    cfg = TrainConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    got = torch.autograd.grad(policy_loss(TokenStats(logp), batch, cfg, float(mask.sum())).loss, logp)[0]
    expected = torch.zeros_like(logp)
    for b in range(2):
        for t in range(5):
            x = logp[b, t].detach().clone().requires_grad_()
            r = torch.exp(x - old[b, t])
            surrogate = -torch.minimum(r * adv[b], r.clamp(0.8, 1.2) * adv[b])
            w = torch.exp(old[b, t] - rollout[b, t]).clamp(0.5, 2.0)
            expected[b, t] = torch.autograd.grad(surrogate * w * mask[b, t] / mask.sum(), x)[0]
    assert torch.allclose(got, expected, atol=1e-12)
    weights = torch.exp(old - rollout).clamp(0.5, 2.0)
    assert weights[0, 1] == 0.5 and weights[0, 2] == 2.0 and weights[1, 3] == 2.0  # both bounds bind
    with pytest.raises(ValueError, match="--use-tis needs Batch.rollout_logprobs"):
        policy_loss(TokenStats(logp), Batch(batch.input_ids, mask, adv, old), cfg, 1.0)
