"""compute_loss against numbers worked out by hand (clip-low, clip-high, unclipped; masks; beta; iterations)."""

import math

import pytest
import torch

from conftest import stub_log_probs
from train import MicroBatch, aggregate_loss, dapo_per_token_loss, group_advantages, k3_kl, keep_groups

# One group of G=2 responses, T=3 tokens; old log-probs are 0, so the ratio r_t = exp(logp_t).
RATIOS = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.5, 2.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# Per token, -min(r*A, clip(r, 0.8, 1.28)*A):
#   A=+1: r=1.5 -> -1.28 (clip-high)   r=1.1 -> -1.1 (inside)   r=0.5 -> -0.5 (below 0.8 but A>0: unclipped)
#   A=-1: r=0.5 -> +0.8 (clip-low)     r=1.5 -> +1.5 (A<0: unclipped)   r=2.0 -> masked out
HAND_TOKEN_LOSSES = [-1.28, -1.1, -0.5, 0.8, 1.5]
HAND_LOSS = sum(HAND_TOKEN_LOSSES) / 5  # the seed: a group's token sum / its 5 tokens = -0.116
# d loss / d logp_t = -A * r_t / 5 where unclipped, 0 where clipped or masked
HAND_GRAD = torch.tensor([[0.0, -1.1 / 5, -0.5 / 5], [0.0, 1.5 / 5, 0.0]])


def inputs_for(log_probs, ref=None):
    n, t = log_probs.shape
    return MicroBatch(
        prompt_response_ids=torch.zeros(n, t + 2, dtype=torch.long),
        attention_mask=torch.ones(n, t + 2, dtype=torch.long),
        action_mask=MASK,
        advantages=ADVANTAGES,
        old_action_log_probs=torch.zeros(n, t),
        ref_action_log_probs=ref,
    )


def test_clip_low_high_and_unclipped_with_old_log_probs(make_trainer):
    trainer = make_trainer(num_generations=2, num_iterations=2)
    log_probs = RATIOS.log().requires_grad_()
    stub_log_probs(trainer, log_probs)
    loss, metrics = trainer.compute_loss(trainer.model, inputs_for(log_probs), return_metrics=True)
    assert loss.item() == pytest.approx(HAND_LOSS, abs=1e-6)
    loss.backward()
    assert torch.allclose(log_probs.grad, HAND_GRAD, atol=1e-6)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(0.2)  # 1 of 5 tokens
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.2)
    # without return_metrics: the same loss alone
    assert trainer.compute_loss(trainer.model, inputs_for(log_probs)).item() == pytest.approx(HAND_LOSS, abs=1e-6)


def test_single_iteration_uses_current_log_probs_as_old(make_trainer):
    # num_iterations == 1: ratio == 1, no clipping, loss = -sum(A * tokens) / tokens = (-3 + 2) / 5
    trainer = make_trainer(num_generations=2, num_iterations=1)
    log_probs = RATIOS.log().requires_grad_()
    stub_log_probs(trainer, log_probs)
    inputs = inputs_for(log_probs)
    inputs.old_action_log_probs = None  # not computed when num_iterations == 1
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx(-0.2, abs=1e-7)
    loss.backward()
    expected = -ADVANTAGES.unsqueeze(1) * MASK / 5
    assert torch.allclose(log_probs.grad, expected, atol=1e-7)


def test_beta_adds_k3_on_masked_tokens(make_trainer):
    beta = 0.1
    trainer = make_trainer(num_generations=2, num_iterations=2, beta=beta)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    log_probs = RATIOS.log().requires_grad_()
    stub_log_probs(trainer, log_probs)
    ref = torch.zeros(2, 3)
    # k3 with ref = 0: exp(-logp) - 1 + logp = 1/r - 1 + log r, on the 5 unmasked tokens
    k3 = [1 / r - 1 + math.log(r) for r in (1.5, 1.1, 0.5, 0.5, 1.5)]
    loss, metrics = trainer.compute_loss(trainer.model, inputs_for(log_probs, ref=ref), return_metrics=True)
    assert loss.item() == pytest.approx((sum(HAND_TOKEN_LOSSES) + beta * sum(k3)) / 5, abs=1e-6)
    assert metrics["kl"] == pytest.approx(sum(k3) / 5, abs=1e-6)


def test_beta_zero_creates_no_reference_model(make_trainer):
    assert make_trainer(beta=0.0).ref_model is None


def test_two_groups_are_averaged(make_trainer):
    # seed aggregation: each group's token mean, then the mean over groups
    trainer = make_trainer(num_generations=2, num_iterations=2)
    log_probs = torch.cat([RATIOS.log(), torch.zeros(2, 3)]).requires_grad_()  # group 2: ratio 1
    stub_log_probs(trainer, log_probs)
    inputs = inputs_for(log_probs)
    inputs.action_mask = torch.cat([MASK, torch.tensor([[1, 0, 0], [1, 1, 1]])])
    inputs.advantages = torch.tensor([1.0, -1.0, 2.0, 0.5])
    inputs.old_action_log_probs = torch.zeros(4, 3)
    group2 = (-2.0 * 1 - 0.5 * 3) / 4  # 1 token at A=2, 3 tokens at A=0.5
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx((HAND_LOSS + group2) / 2, abs=1e-6)


def test_pure_helpers():
    per_token, ratio = dapo_per_token_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, 0.2, 0.28)
    assert torch.allclose(ratio, RATIOS)
    assert torch.allclose(per_token[MASK.bool()], torch.tensor(HAND_TOKEN_LOSSES), atol=1e-6)
    assert k3_kl(torch.zeros(3), torch.zeros(3), torch.ones(3)).abs().max() == 0  # no divergence from itself
    # masked positions (padding, whose log-probs can be anything) give 0, not exp(large) = inf / NaN
    assert k3_kl(torch.tensor([-1000.0, 0.0]), torch.zeros(2), torch.tensor([0, 1])).tolist() == [0.0, 0.0]
    adv = group_advantages(torch.tensor([[3.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]]))
    # mean 1.25, unbiased std 1.5: (3.5 - 1.25) / 1.5 = 1.5 and (0.5 - 1.25) / 1.5 = -0.5
    assert torch.allclose(adv[0], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-6)
    assert adv[1].count_nonzero() == 0
    assert keep_groups(adv, None, "reward").tolist() == [True, False]
    seed_loss = aggregate_loss(per_token, MASK, "seed", num_generations=2)
    assert seed_loss.item() == pytest.approx(HAND_LOSS, abs=1e-6)


def test_clip_low_and_clip_high_bound_their_own_side_under_uneven_advantages(make_trainer):
    """At advantages of +1 and -1 the two clip bounds can trade places unseen (-1.28 + 0.8 = -1.2 + 0.72); at +2 and
    -0.5 they cannot. Per token, -min(r*A, clip(r, 0.8, 1.28)*A):
      A=+2:   r=1.5 -> -2.56 (clip-high)   r=1.1 -> -2.2   r=0.5 -> -1.0 (A>0: unclipped)
      A=-0.5: r=0.5 -> +0.4 (clip-low)     r=1.5 -> +0.75 (A<0: unclipped)
    Swapped (clip(r, 0.72, 1.2)): -2.4 and +0.36, a loss of -0.898 instead of -0.922."""
    trainer = make_trainer(num_generations=2, num_iterations=2)
    log_probs = RATIOS.log().requires_grad_()
    stub_log_probs(trainer, log_probs)
    inputs = inputs_for(log_probs)
    inputs.advantages = torch.tensor([2.0, -0.5])
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx((-2.56 - 2.2 - 1.0 + 0.4 + 0.75) / 5, abs=1e-6)
