"""Issue 5, "The paper's DAPO, exactly": every paper option checked against hand-worked numbers.

filter_metric / max_num_gen_batches (Eq. 11), loss_agg_mode (Eq. 12), the soft overlong punishment
(Eq. 13), overlong_filter, AdamW / warm-up / gradient clipping, and --preset paper (which learns).
"""

import json
import math
import os

import pytest
import torch

from conftest import SEED_REWARDS, as_micro_batch, make_batch, scripted_sampler, stub_log_probs, token_ids
from dapo_utils.cli import parse_cli
from dapo_utils.curves import read_step_log
from dapo_utils.presets import paper_preset
from dapo_utils.trackers import step_record
from reward_func import correctness_reward as real_correctness_reward
from train import (
    DapoArguments,
    aggregate_loss,
    build_args,
    keep_groups,
    loss_normaliser,
    main,
    soft_overlong_punishment,
)

# Several tests replace optimizer.step to capture gradients; the LR scheduler warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

INV_SQRT2 = 1 / math.sqrt(2)  # |advantage| of both responses in a G=2 group with unequal totals


# ---------- helpers ----------
def plain_token(trainer, text="1"):
    """One ordinary (non-EOS) token id."""
    (token,) = token_ids(trainer.tokenizer, text)
    assert token not in trainer.eos_token_ids
    return token


def varied(prompts, responses, answers):
    """Totals 0, 1 in every group of 2 (or 0, 1, 0, 1 in groups of 4): every group has a signal."""
    return [float(i % 2) for i in range(len(responses))]


def constant(prompts, responses, answers):
    return [1.0] * len(responses)


# ---------- 1. loss aggregation, Eq. (12) ----------
# Two groups of G=2 responses, T=4; masked positions hold 1000 so that any leak shows.
PER_TOKEN = torch.tensor(
    [
        [1.0, 2.0, 3.0, 4.0],  # group A, 4 tokens, sum 10
        [5.0, 1000, 1000, 1000],  # group A, 1 token,  sum 5
        [-1.0, -2.0, 1000, 1000],  # group B, 2 tokens, sum -3
        [2.0, 2.0, 2.0, 2.0],  # group B, 4 tokens, sum 8
    ]
)
AGG_MASK = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
SEED_LOSS = ((10 + 5) / 5 + (-3 + 8) / 6) / 2  # group token means 3 and 5/6, their mean 23/12 = 1.91667
TOKEN_MEAN_LOSS = (10 + 5 - 3 + 8) / 11  # every token alike: 20/11 = 1.81818
SEQ_MEAN_LOSS = (10 / 4 + 5 / 1 + -3 / 2 + 8 / 4) / 4  # response means 2.5, 5, -1.5, 2 -> 2.0


def test_aggregate_loss_three_modes_by_hand():
    def agg(mode, **kwargs):
        return aggregate_loss(PER_TOKEN, AGG_MASK, mode, num_generations=2, **kwargs).item()

    assert agg("seed") == pytest.approx(SEED_LOSS, abs=1e-6)
    assert agg("token-mean") == pytest.approx(TOKEN_MEAN_LOSS, abs=1e-6)
    assert agg("seq-mean-token-mean") == pytest.approx(SEQ_MEAN_LOSS, abs=1e-6)
    # The three really differ on these inputs (unequal lengths within and across groups).
    assert (
        min(abs(SEED_LOSS - TOKEN_MEAN_LOSS), abs(SEED_LOSS - SEQ_MEAN_LOSS), abs(TOKEN_MEAN_LOSS - SEQ_MEAN_LOSS))
        > 0.08
    )  # 0.098, 0.083, 0.182
    # A micro-batch's units: 11 tokens, 4 responses, 2 groups.
    assert [loss_normaliser(AGG_MASK, mode, 2) for mode in ("token-mean", "seq-mean-token-mean", "seed")] == [11, 4, 2]
    # Its share of a step whose micro-batches hold 25 tokens in all: 20 / 25 = 0.8.
    assert agg("token-mean", normaliser=25) == pytest.approx(0.8, abs=1e-6)
    # normaliser = this micro-batch's own 11 tokens: the micro-batch mean again.
    assert agg("token-mean", normaliser=11) == pytest.approx(TOKEN_MEAN_LOSS, abs=1e-6)
    # seed in a step of 2 such micro-batches (4 groups): (3 + 5/6) / 4 = 23/24 = SEED_LOSS / 2, the old mean / GA
    assert agg("seed", normaliser=4) == pytest.approx(23 / 24, abs=1e-6) == pytest.approx(SEED_LOSS / 2, abs=1e-6)
    # seq-mean-token-mean in a step of 8 responses: (2.5 + 5 - 1.5 + 2) / 8 = 1.0
    assert agg("seq-mean-token-mean", normaliser=8) == pytest.approx(1.0, abs=1e-6)
    # Fully masked: 0 (not NaN) in every mode, also when the step has no unit at all.
    for mode in ("seed", "token-mean", "seq-mean-token-mean"):
        assert aggregate_loss(PER_TOKEN, torch.zeros_like(AGG_MASK), mode, num_generations=2).item() == 0.0
        assert aggregate_loss(PER_TOKEN, torch.zeros_like(AGG_MASK), mode, 2, normaliser=0).item() == 0.0


# ---------- 2. token-mean under gradient accumulation ----------
def step_normaliser(trainer, micro_batches):
    """The loss denominator the trainer gives every micro-batch of a step: the sum of their units."""
    args = trainer.args
    return sum(loss_normaliser(m.action_mask, args.loss_agg_mode, args.num_generations) for m in micro_batches)


def step_gradients(trainer, micro_batches, normalisers):
    """Run the real train_step over micro_batches (one normaliser each); return the accumulated .grad.

    train_step only accumulates gradients, so the model never changes and can be reused.
    """
    trainer.optimizer.zero_grad()
    for inputs, normaliser in zip(micro_batches, normalisers, strict=True):
        trainer.train_step(trainer.model, inputs, normaliser)
    captured = {name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad()
    return captured


def max_difference(a, b):
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_token_mean_gradient_is_independent_of_accumulation(make_trainer):
    trainer = make_trainer(reward_funcs=[varied], num_generations=2, max_generate_length=8, loss_agg_mode="token-mean")
    eos, x, y = trainer.tokenizer.eos_token_id, plain_token(trainer, "1"), plain_token(trainer, "2")
    # micro-batch 1: responses of 2 and 5 tokens (7); micro-batch 2: 8 (cut, no EOS) and 3 tokens (11).
    scripted_sampler(trainer, [[x, eos], [x, y, x, y, eos]])
    first, _ = trainer.generate_experiences(make_batch(trainer, offset=0))
    scripted_sampler(trainer, [[y] * 8, [y, x, eos]])
    second, _ = trainer.generate_experiences(make_batch(trainer, offset=3))
    micro = [as_micro_batch(trainer, e) for e in (first, second)]
    assert [int(m.action_mask.sum()) for m in micro] == [7, 11]
    assert micro[0].prompt_response_ids.shape != micro[1].prompt_response_ids.shape  # padding really differs
    big = as_micro_batch(trainer, first, second)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert step_normaliser(trainer, micro) == step_normaliser(trainer, [big]) == 18  # the step's 7 + 11 tokens

    accumulated = step_gradients(trainer, micro, [18, 18])  # GA=2, each micro-batch: its sum / 18
    one_batch = step_gradients(trainer, [big], [18])  # GA=1: sum / 18
    scale = max(g.abs().max().item() for g in one_batch.values())
    assert scale > 1e-3  # a real gradient
    assert max_difference(accumulated, one_batch) < 1e-6

    # The same comparison fails for a loss that is not the step's token mean:
    # per-micro-batch token means, averaged: 1/2 * (sum_1 / 7 + sum_2 / 11) != (sum_1 + sum_2) / 18
    per_micro_mean = step_gradients(trainer, micro, [2 * 7, 2 * 11])
    assert max_difference(per_micro_mean, one_batch) > 1e-3 * scale
    # the seed's per-group token mean, accumulated the same way: 1/2 * (sum_1 / 7 + sum_2 / 11) again
    trainer.args.loss_agg_mode = "seed"
    assert step_normaliser(trainer, micro) == 2  # two groups
    seed_accumulated = step_gradients(trainer, micro, [2, 2])
    assert max_difference(seed_accumulated, one_batch) > 1e-3 * scale
    # (with one group per micro-batch, the seed's mean over groups equals the per-micro-batch token mean)
    assert max_difference(seed_accumulated, per_micro_mean) < 1e-6
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing was stepped


# ---------- 3. dynamic sampling, Eq. (11) ----------
def test_keep_groups_on_correctness():
    correct = torch.tensor(
        [
            [True, True, True, True],  # all correct: no signal
            [False, False, False, False],  # none correct: no signal
            [True, False, False, False],  # mixed: kept
            [False, True, True, True],  # mixed: kept
        ]
    )
    advantages = torch.tensor(
        [[1.0, -1.0, 0.0, 0.0], [0.5, -0.5, 0.5, -0.5], [0.0, 0.0, 0.0, 0.0], [1.5, -0.5, -0.5, -0.5]]
    )
    assert keep_groups(advantages, correct, "correctness").tolist() == [False, False, True, True]
    assert keep_groups(advantages, correct, "reward").tolist() == [True, True, False, True]  # non-zero advantages
    assert keep_groups(advantages, correct, "none").tolist() == [True, True, True, True]


def correctness_reward(prompts, responses, answers):
    """Stands in for reward_func.correctness_reward: the trainer recognises it by this __name__."""
    return [2.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0]


def bonus(prompts, responses, answers):
    return [0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 2.0]


# Four groups of G=2 (correctness, bonus) -> totals:
#   group 0: correct [2, 0], bonus [0, 0]     -> [2, 0]    mixed correctness, unequal totals
#   group 1: correct [0, 0], bonus [0, 0.5]   -> [0, 0.5]  none correct,      unequal totals
#   group 2: correct [2, 2], bonus [0.5, 0]   -> [2.5, 2]  all correct,       unequal totals
#   group 3: correct [2, 0], bonus [0, 2]     -> [2, 2]    mixed correctness, equal totals
@pytest.mark.parametrize(
    "filter_metric, kept",
    [("reward", [0, 1, 2]), ("correctness", [0, 3]), ("none", [0, 1, 2, 3])],
)
def test_filter_metric_in_generate_experiences(make_trainer, filter_metric, kept):
    trainer = make_trainer(reward_funcs=[correctness_reward, bonus], num_generations=2, filter_metric=filter_metric)
    x = plain_token(trainer)
    scripted_sampler(trainer, [[x, trainer.tokenizer.eos_token_id]] * 8)
    groups, metrics = trainer.generate_experiences(make_batch(trainer, n=4))
    # advantages of a G=2 group: +-(difference / 2) / (|difference| / sqrt 2) = +-1/sqrt 2, or 0 when equal
    all_advantages = [[INV_SQRT2, -INV_SQRT2], [-INV_SQRT2, INV_SQRT2], [INV_SQRT2, -INV_SQRT2], [0.0, 0.0]]
    assert len(groups) == len(kept)
    for group, g in zip(groups, kept):
        assert group.advantages.tolist() == pytest.approx(all_advantages[g], abs=1e-6)
    assert trainer.state.skipped_groups == 4 - len(kept)
    assert metrics["frac_groups_skipped"] == [float(g not in kept) for g in range(4)]


def test_correctness_filter_with_the_real_reward(make_trainer):
    # Both responses are right (correctness 2.0 each) but differ in format, so their totals differ:
    #   "<answer>\nA\n</answer>\n":                 2 + digit 0.5 + hard 0   + marks 0.25 = 2.75
    #   "<think>\n1\n</think>\n<answer>\nA\n</answer>\n": 2 + 0.5       + 0.5    + 0.5        = 3.5
    # The seed's rule keeps the group; the paper's drops it (all correct: no accuracy signal).
    for filter_metric, expected_kept in (("reward", 1), ("correctness", 0)):
        trainer = make_trainer(
            reward_funcs=list(SEED_REWARDS), num_generations=2, max_generate_length=16, filter_metric=filter_metric
        )
        tok, batch = trainer.tokenizer, make_batch(trainer)
        answer = int(batch["answer"][0])
        short = token_ids(tok, f"<answer>\n{answer}\n</answer>\n") + [tok.eos_token_id]
        full = token_ids(tok, f"<think>\n1\n</think>\n<answer>\n{answer}\n</answer>\n") + [tok.eos_token_id]
        scripted_sampler(trainer, [short, full])
        groups, metrics = trainer.generate_experiences(batch)
        assert metrics["rewards/correctness_reward"] == [2.0, 2.0]
        assert metrics["reward"] == [2.75, 3.5]
        assert len(groups) == expected_kept


def test_correctness_filter_needs_correctness_reward(make_trainer):
    with pytest.raises(ValueError, match="correctness_reward"):
        make_trainer(reward_funcs=[varied], filter_metric="correctness")
    assert make_trainer(reward_funcs=[real_correctness_reward], filter_metric="correctness").reward_names == [
        "correctness_reward"
    ]


# ---------- 4. max_num_gen_batches ----------
def count_rounds(trainer):
    """The prompt batches (rounds) each sampling call of generate_experiences samples."""
    calls, original = [], trainer.generate_experiences
    trainer.generate_experiences = lambda batch: calls.append(len(batch["prompt"])) or original(batch)
    return calls


def test_max_num_gen_batches_gives_up_after_that_many_rounds(make_trainer):
    trainer = make_trainer(reward_funcs=[constant], max_num_gen_batches=3, eval_steps=1000, max_generate_length=4)
    calls = count_rounds(trainer)  # batch_size 1: a prompt per round
    with pytest.raises(RuntimeError, match="max_num_gen_batches"):
        trainer.train()
    assert calls == [2, 1] and trainer.state.skipped_groups == 3 and trainer.update_steps == 0  # the step's 2, then 1


def num_gen_batches_trainer(make_trainer, rounds, max_num_gen_batches):
    """GA=2 of 1 group each; the rewards alternate: equal totals (skipped) on odd rounds, varied on even ones,
    so that every optimizer step takes exactly 4 sampling rounds (skip, keep, skip, keep): calls of 2, 1, 1."""

    def alternating(prompts, responses, answers):  # (evaluation scores rewards too, so count rounds, not calls)
        first = len(rounds) - len(prompts) // 4 + 1  # this call's first round, counted from 1
        return [1.0 if (first + i // 4) % 2 else float(i % 4) for i in range(len(responses))]

    trainer = make_trainer(
        reward_funcs=[alternating],
        max_num_gen_batches=max_num_gen_batches,
        max_steps=2,
        gradient_accumulation_steps=2,
        eval_steps=1000,
        max_generate_length=4,
        loss_agg_mode="token-mean",
    )
    original = trainer.generate_experiences
    trainer.generate_experiences = lambda batch: rounds.extend([1] * len(batch["prompt"])) or original(batch)
    return trainer


def test_num_gen_batches_and_step_tokens_in_the_training_loop(make_trainer):
    rounds = []  # one per prompt batch sampled
    # num_gen_batches counts the rounds of a whole optimizer step (verl's meaning): 4, which max_num_gen_batches=4 allows.
    trainer = num_gen_batches_trainer(make_trainer, rounds, max_num_gen_batches=4)
    micro_steps = []  # (normaliser, this micro-batch's tokens) of every train_step
    original_step = trainer.train_step
    trainer.train_step = lambda model, inputs, normaliser=None: (
        micro_steps.append((normaliser, int(inputs.action_mask.sum()))) or original_step(model, inputs, normaliser)
    )
    trainer.train()
    assert trainer.update_steps == 2 and len(rounds) == 8  # 2 steps x 4 rounds
    # token-mean's denominator: both micro-batches of a step get the step's total token count
    assert len(micro_steps) == 4
    for (total_1, tokens_1), (total_2, tokens_2) in (micro_steps[:2], micro_steps[2:]):
        assert total_1 == total_2 == tokens_1 + tokens_2
    assert [record["num_gen_batches"] for record in trainer.history] == [4.0, 4.0]  # logged once per step
    assert [record["skipped_groups"] for record in trainer.history] == [2, 4]
    assert [record["frac_groups_skipped"] for record in trainer.history] == [0.5, 0.5]  # 2 of the step's 4 groups


def test_max_num_gen_batches_limits_the_rounds_of_one_optimizer_step(make_trainer):
    # The same run with max_num_gen_batches=3: the first step has 1 of its 2 groups after 3 rounds and gives up.
    rounds = []
    trainer = num_gen_batches_trainer(make_trainer, rounds, max_num_gen_batches=3)
    with pytest.raises(RuntimeError, match="3 sampling rounds gave only 1 of 2 valid groups"):
        trainer.train()
    assert len(rounds) == 3 and trainer.update_steps == 0 and trainer.state.skipped_groups == 2


# ---------- 5. soft overlong punishment, Eq. (13) ----------
def test_soft_overlong_punishment_is_not_a_reward_function(make_trainer):
    # Eq. (13) is added to the total inside generate_experiences, with its own scale: it takes no reward weight.
    trainer = make_trainer(overlong_buffer_len=4, max_generate_length=12)
    assert len(trainer.reward_funcs) == 4 and len(trainer.reward_tokenizers) == 4
    assert trainer.reward_names == ["correctness_reward", "digit_reward", "hard_format_reward", "mark_reward"]
    assert trainer.reward_weights.tolist() == [1.0] * 4
    # exactly one weight per reward function
    assert make_trainer(overlong_buffer_len=4, reward_weights=[2.0, 1.0, 1.0, 0.5]).reward_weights.tolist() == [
        2.0,
        1.0,
        1.0,
        0.5,
    ]
    with pytest.raises(ValueError, match="reward_weights has 5 entries but there are 4"):
        make_trainer(overlong_buffer_len=4, reward_weights=[2.0, 1.0, 1.0, 0.5, 3.0])
    assert len(make_trainer().reward_funcs) == 4


def test_soft_overlong_punishment_values(make_trainer):
    def zero(prompts, responses, answers):
        return [0.0] * len(responses)

    trainer = make_trainer(
        reward_funcs=[zero],
        overlong_buffer_len=4,
        max_generate_length=12,
        overlong_penalty_factor=0.5,
        filter_metric="none",
    )
    eos, x = trainer.tokenizer.eos_token_id, plain_token(trainer)
    # Response lengths (EOS included): group 1: 3, 9, 10, 12; group 2: 8, 12 without EOS (cut), 1, 11.
    lengths = [3, 9, 10, 12, 8, 12, 1, 11]
    responses = [[x] * (n - 1) + [eos] for n in lengths]
    responses[5] = [x] * 12
    scripted_sampler(trainer, responses)
    _, metrics = trainer.generate_experiences(make_batch(trainer, n=2))
    assert metrics["completions/length"] == lengths
    assert metrics["completions/clipped_ratio"] == [0, 0, 0, 0, 0, 1, 0, 0]  # only the one without EOS was cut
    # L_max = 12, L_cache = 4, expected = 8:  R = 0 if |y| <= 8, (8 - |y|) / 4 up to 12, -1 beyond
    #   3 -> 0,  9 -> -0.25,  10 -> -0.5,  12 -> -1,  8 -> 0,  12 (cut) -> -1,  1 -> 0,  11 -> -0.75
    eq13 = [0.0, -0.25, -0.5, -1.0, 0.0, -1.0, 0.0, -0.75]
    expected = [0.5 * r for r in eq13]  # overlong_penalty_factor
    assert metrics["rewards/soft_overlong_punishment"] == pytest.approx(expected, abs=1e-7)
    assert metrics["rewards/zero"] == [0.0] * 8
    assert metrics["reward"] == pytest.approx(expected, abs=1e-7)  # it is part of the total
    # the pure function: a 13-token response (beyond L_max) is capped at -1
    values = soft_overlong_punishment(torch.tensor([7, 11, 13]), max_length=12, cache_length=4, penalty_factor=0.5)
    assert values.tolist() == pytest.approx([0.0, 0.5 * -0.75, 0.5 * -1.0], abs=1e-7)
    # off (overlong_buffer_len 0): not logged, not added
    trainer = make_trainer(reward_funcs=[zero], max_generate_length=12, filter_metric="none")
    scripted_sampler(trainer, responses)
    _, metrics = trainer.generate_experiences(make_batch(trainer, n=2))
    assert "rewards/soft_overlong_punishment" not in metrics and metrics["reward"] == [0.0] * 8


def test_single_reward_function_with_overlong_punishment(make_trainer):
    # load_reward_funcs accepts a single callable (not in a list); so must the weights.
    trainer = make_trainer(reward_funcs=real_correctness_reward, overlong_buffer_len=4)
    assert trainer.reward_names == ["correctness_reward"]
    assert trainer.reward_weights.tolist() == [1.0]


# ---------- 6. overlong filter ----------
def test_overlong_filter_masks_truncated_responses(make_trainer):
    for overlong_filter in (True, False):
        trainer = make_trainer(
            reward_funcs=[varied], num_generations=2, max_generate_length=6, overlong_filter=overlong_filter
        )
        eos, x = trainer.tokenizer.eos_token_id, plain_token(trainer)
        scripted_sampler(trainer, [[x, x, eos], [x] * 6])  # ends after 3 tokens; cut at 6 without EOS
        kept, _ = trainer.generate_experiences(make_batch(trainer))
        inputs = as_micro_batch(trainer, kept)
        assert inputs.attention_mask[:, -6:].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]  # unchanged either way
        truncated_row = [0] * 6 if overlong_filter else [1] * 6
        assert inputs.action_mask.tolist() == [[1, 1, 1, 0, 0, 0], truncated_row]
        # totals [0, 1] -> advantages [-1/sqrt 2, +1/sqrt 2]; ratio 1, so each token's loss is -A:
        #   row 0: +0.7071 on 3 tokens, row 1 (cut): -0.7071 on 6 tokens
        log_probs = torch.zeros(2, 6, requires_grad=True)
        stub_log_probs(trainer, log_probs)
        loss = trainer.compute_loss(trainer.model, inputs)
        if overlong_filter:  # seed: 3 * 0.7071 / 3 tokens
            assert loss.item() == pytest.approx(INV_SQRT2, abs=1e-6)
        else:  # seed: (3 * 0.7071 - 6 * 0.7071) / 9 tokens = -0.2357
            assert loss.item() == pytest.approx(-INV_SQRT2 / 3, abs=1e-6)
        loss.backward()
        expected_grad = torch.tensor([[INV_SQRT2] * 3 + [0.0] * 3, [-INV_SQRT2 * (not overlong_filter)] * 6]) / (
            3 if overlong_filter else 9
        )
        assert torch.allclose(log_probs.grad, expected_grad, atol=1e-6)


def test_overlong_filter_fully_masked_group_has_zero_loss(make_trainer):
    trainer = make_trainer(reward_funcs=[varied], num_generations=2, max_generate_length=6, overlong_filter=True)
    x, y = plain_token(trainer, "1"), plain_token(trainer, "2")
    scripted_sampler(trainer, [[x] * 6, [y] * 6])  # both cut: the group is kept (totals 0, 1) but fully masked
    kept, _ = trainer.generate_experiences(make_batch(trainer))
    inputs = as_micro_batch(trainer, kept)
    assert inputs.action_mask.sum() == 0 and inputs.attention_mask[:, -6:].sum() == 12
    for mode in ("seed", "token-mean", "seq-mean-token-mean"):
        trainer.args.loss_agg_mode = mode
        log_probs = torch.zeros(2, 6, requires_grad=True)
        stub_log_probs(trainer, log_probs)
        normaliser = loss_normaliser(inputs.action_mask, mode, 2)  # 0 tokens, 2 responses, 1 group
        assert normaliser == {"seed": 1, "token-mean": 0, "seq-mean-token-mean": 2}[mode]
        loss = trainer.compute_loss(trainer.model, inputs, normaliser)
        assert loss.item() == 0.0, mode
        loss.backward()
        assert not log_probs.grad.any()


def test_fully_masked_micro_batch_logs_finite_metrics(make_trainer):
    # The step's metrics (metrics.jsonl) must stay numbers when overlong_filter masks a whole micro-batch:
    # a mean over zero tokens is NaN, which poisons the step's means and is not valid JSON.
    trainer = make_trainer(
        reward_funcs=[varied],
        num_generations=2,
        max_generate_length=6,
        overlong_filter=True,
        gradient_accumulation_steps=1,
    )
    x, y = plain_token(trainer, "1"), plain_token(trainer, "2")
    scripted_sampler(trainer, [[x] * 6, [y] * 6])
    kept, round_metrics = trainer.generate_experiences(make_batch(trainer))
    inputs = as_micro_batch(trainer, kept)
    metrics = trainer.train_step(trainer.model, inputs)
    assert metrics["num_tokens"] == 0 and metrics["loss"] == 0.0
    # No token to average over: the diagnostics are None (null in metrics.jsonl), never NaN.
    assert [metrics[key] for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean")] == [None] * 3
    nan = {key: value for key, value in metrics.items() if value is not None and math.isnan(value)}
    nan.update({key: values for key, values in round_metrics.items() if any(math.isnan(v) for v in values)})
    assert not nan, nan
    record = step_record(1, {key: [value] for key, value in metrics.items()})
    assert record["entropy"] is None and json.loads(json.dumps(record)) == record  # valid JSON, no NaN


# ---------- 7. optimizer, warm-up, clipping ----------
def zero_advantage_inputs(trainer):
    """One kept group whose advantages are all 0: every parameter's gradient is exactly 0."""
    x = plain_token(trainer)
    scripted_sampler(trainer, [[x, trainer.tokenizer.eos_token_id]] * trainer.args.num_generations)
    kept, _ = trainer.generate_experiences(make_batch(trainer))
    assert not kept[0].advantages.any()
    return as_micro_batch(trainer, kept)


def test_adam_by_default_adamw_with_weight_decay(make_trainer):
    lr, wd = 1e-3, 0.1
    adam = make_trainer(reward_funcs=[constant], filter_metric="none", gradient_accumulation_steps=1)
    assert type(adam.optimizer) is torch.optim.Adam and adam.optimizer.param_groups[0]["weight_decay"] == 0
    adamw = make_trainer(reward_funcs=[constant], filter_metric="none", gradient_accumulation_steps=1, weight_decay=wd)
    assert type(adamw.optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in adamw.optimizer.param_groups] == [wd] and adamw.optimizer.param_groups[0][
        "lr"
    ] == lr
    for trainer, factor in ((adam, 1.0), (adamw, 1 - lr * wd)):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_step(trainer.model, zero_advantage_inputs(trainer))
        trainer.optimizer.step()
        # A zero gradient moves Adam by 0; AdamW still decays: w <- w - lr * wd * w = 0.9999 w.
        for old, new in zip(before, trainer.model.parameters()):
            assert torch.allclose(new.detach(), old * factor, rtol=0, atol=1e-8)
        moved = max((new.detach() - old).abs().max().item() for old, new in zip(before, trainer.model.parameters()))
        assert (moved == 0.0) if factor == 1.0 else (moved > 1e-6)


def test_linear_warmup(make_trainer):
    trainer = make_trainer(
        reward_funcs=[varied],
        warmup_steps=4,
        max_steps=5,
        gradient_accumulation_steps=1,
        eval_steps=1000,
        max_generate_length=4,
    )
    used = []
    original = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: used.append(trainer.optimizer.param_groups[0]["lr"]) or original(*a, **k)
    trainer.train()
    lr = 1e-3
    expected = [lr * 1 / 4, lr * 2 / 4, lr * 3 / 4, lr, lr]  # (step + 1) / warmup_steps, then 1
    assert [record["learning_rate"] for record in trainer.history] == pytest.approx(expected, rel=1e-9)
    assert used == pytest.approx(expected, rel=1e-9)  # the logged rate is the one the step used


def global_norm(grads):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()


def one_step_gradients(trainer):
    """Train one optimizer step (GA=1); return the gradient after the micro-step's backward (pre-clip) and the one
    optimizer.step sees (post-clip). optimizer.step is replaced by the capture: the model does not move."""
    pre, post = {}, {}
    original_step = trainer.train_step

    def train_step(model, inputs, normaliser=None):
        metrics = original_step(model, inputs, normaliser)
        pre.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        return metrics

    trainer.train_step = train_step
    trainer.optimizer.step = lambda *a, **k: post.update(
        {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    )
    trainer.train()
    assert trainer.update_steps == 1 and pre and post
    return pre, post


def test_max_grad_norm_clips_and_logs_the_pre_clip_norm(make_trainer):
    settings = dict(
        reward_funcs=[varied], gradient_accumulation_steps=1, max_steps=1, eval_steps=1000, max_generate_length=8
    )
    # max_grad_norm = 0: no clipping, the gradient is untouched and its norm logged.
    trainer = make_trainer(max_grad_norm=0.0, **settings)
    reference, captured = one_step_gradients(trainer)
    norm = global_norm(reference)
    assert norm > 0 and trainer.history[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert max_difference(captured, reference) < 1e-7

    # max_grad_norm = norm / 4: every gradient is scaled by max / (norm + 1e-6); the log keeps the pre-clip norm.
    max_norm = norm / 4
    trainer = make_trainer(max_grad_norm=max_norm, output_dir=trainer.args.output_dir + "_clipped", **settings)
    reference, captured = one_step_gradients(trainer)
    norm = global_norm(reference)  # this run's own pre-clip norm (the same sampling seed: about the same)
    assert norm > 2 * max_norm and trainer.history[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    clipped_norm = global_norm(captured)
    assert clipped_norm <= max_norm * (1 + 1e-5) and clipped_norm == pytest.approx(max_norm, rel=1e-4)
    scale = max_norm / (norm + 1e-6)
    assert max_difference(captured, {n: g * scale for n, g in reference.items()}) < 1e-7


# ---------- 8. --preset paper ----------
def test_paper_preset_and_overrides():
    args = build_args("paper", {})
    assert (args.filter_metric, args.loss_agg_mode) == ("correctness", "token-mean")
    assert args.overlong_buffer_len == 128 // 5 == 25 and args.overlong_penalty_factor == 1.0
    assert (args.weight_decay, args.warmup_steps, args.max_grad_norm) == (0.1, 10, 1.0)
    assert build_args("paper", {"max_grad_norm": 0.5}).max_grad_norm == 0.5  # overrides win
    assert build_args("paper", {"max_generate_length": 32}).overlong_buffer_len == 6  # L_cache follows L_max
    assert build_args("paper", {"overlong_buffer_len": 0}).overlong_buffer_len == 0
    assert paper_preset(20480)["overlong_buffer_len"] == 4096  # the paper's own numbers
    seed = build_args("seed", {})
    assert (
        seed.filter_metric,
        seed.loss_agg_mode,
        seed.overlong_buffer_len,
        seed.weight_decay,
        seed.warmup_steps,
        seed.max_grad_norm,
    ) == ("reward", "seed", 0, 0.0, 0, 0.0)
    cli, overrides = parse_cli(DapoArguments, ["--preset", "paper", "--lr=1e-5"])
    assert cli.preset == "paper" and overrides == {"lr": 1e-5}
    args = build_args(cli.preset, overrides)
    assert args.lr == 1e-5 and args.filter_metric == "correctness" and args.weight_decay == 0.1
    assert parse_cli(DapoArguments, [])[0].preset == "seed"
    assert DapoArguments().filter_metric == "reward"


# ---------- 9. the paper's DAPO learns ----------
def test_paper_preset_held_out_accuracy_climbs_in_160_steps(tmp_path):
    # `python train.py --demo --preset paper`: every paper option on, dynamic sampling by correctness
    # included, on the demo world (noisy warm-up: the mode is right, samples are right ~1 time in 5
    # at temperature 1, so most groups of 8 are mixed and kept), lr 3e-4, 160 steps, 4 per rollout.
    trainer = main(["--demo", "--preset", "paper", f"--output_dir={tmp_path / 'demo'}"])
    args = trainer.args
    assert (
        args.filter_metric,
        args.loss_agg_mode,
        args.overlong_buffer_len,
        args.weight_decay,
        args.warmup_steps,
        args.max_grad_norm,
    ) == ("correctness", "token-mean", 4, 0.1, 10, 1.0)
    assert (args.lr, args.max_steps, args.seed, args.temperature) == (3e-4, 160, 42, 1.0)
    assert (
        "rewards/soft_overlong_punishment/mean" in trainer.history[0] and type(trainer.optimizer) is torch.optim.AdamW
    )
    history = trainer.history
    assert trainer.update_steps == 160 and len(history) == 160
    assert history[0]["learning_rate"] == pytest.approx(3e-5) and history[-1]["learning_rate"] == pytest.approx(3e-4)
    # 4 optimizer steps per rollout: the first step of each rollout sampled, and the later ones move the
    # ratio away from 1, so the clip binds.
    sampled = [record for record in history if record["reward"] is not None]  # the others: null
    assert len(sampled) == 160 // 4
    assert any(record["clip_ratio/low_mean"] + record["clip_ratio/high_mean"] > 0 for record in history)
    # The filter is at work: some groups are all right or all wrong, and refilling takes extra rounds.
    assert trainer.state.skipped_groups > 0 and max(record["num_gen_batches"] for record in sampled) > 1
    # Held-out accuracy (all 200 test problems, every 20 steps, sampled at temperature 1) climbs.
    accuracy = read_step_log(os.path.join(args.output_dir, "accuracy_losses.txt"))
    assert sorted(accuracy) == list(range(0, 161, 20))
    assert accuracy[160] - accuracy[0] >= 0.30, accuracy

    def gain(key):  # the last 10 rollouts against the first 10
        values = [record[key] for record in sampled]
        return sum(values[-10:]) / 10 - sum(values[:10]) / 10

    assert gain("rewards/correctness_reward/mean") >= 0.3, gain("rewards/correctness_reward/mean")
