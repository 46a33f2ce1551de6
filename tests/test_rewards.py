"""Every reward branch with its exact value (the seed's numbers)."""

import math

import pytest
import torch

from reward_func import (
    correctness_reward,
    digit_reward,
    extract_answer,
    hard_format_reward,
    mark_num,
    mark_reward,
    normalize_answer,
)
from train import soft_overlong_punishment

PERFECT = "<think>\n3+5=8\n</think>\n<answer>\n8\n</answer>\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>72</answer>", "72"),
        ("<answer>\n答案是 3.75 元\n</answer>", "3.75"),
        ("<answer>3/4</answer>", "3/4"),
        ("<answer>先算 12 再算 30，最后 42</answer>", "42"),  # the last number
        ("<answer>1,000</answer>", "000"),  # no thousands separators: the seed's regex
        ("<answer>-5</answer>", "5"),  # no sign: the seed's regex
        ("<answer></answer>", ""),  # empty tag
        ("<answer>没有数字</answer>", ""),  # no number
        ("答案是 72", ""),  # no tag
        ("<answer>72", ""),  # unclosed tag
        ("<answer>1</answer><answer>2</answer>", "1"),  # the first block
        ("<answer>\n1\n2\n</answer>", "2"),  # DOTALL: spans lines
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("answer", [72, 72.0, "72", " 72 ", "72.0", torch.tensor(72), torch.tensor(72.0)])
def test_normalize_answer_matches_seed_int_formatting(answer):
    assert normalize_answer(answer) == "72"


def test_normalize_answer_keeps_non_integers():
    assert normalize_answer(3.5) == "3.5"
    assert normalize_answer("3/4") == "3/4"


def test_correctness_reward_values_and_answer_types():
    responses = ["<answer>72</answer>", "<answer>71</answer>", "no tag", "<answer>72.0</answer>"]
    for answer in (torch.tensor(72), 72, 72.0, "72"):
        assert correctness_reward(None, responses, [answer] * 4) == [2.0, 0.0, 0.0, 0.0]


def test_digit_reward():
    responses = ["<answer>72</answer>", "<answer>3.5</answer>", "<answer>3/4</answer>", "<answer>x</answer>", "72"]
    assert digit_reward(None, responses, [0] * 5) == [0.5, 0.0, 0.0, 0.0, 0.0]


def test_hard_format_reward():
    responses = [
        PERFECT,
        PERFECT.rstrip("\n"),  # missing the final newline
        "x" + PERFECT,  # text before <think>
        "<think>\n\n</think>\n<answer>\n\n</answer>\n",  # empty bodies still match .*?
        "<think>\na\nb\n</think>\n<answer>\n8\n</answer>\n",  # multi-line thinking (DOTALL)
        "<answer>\n8\n</answer>\n",
    ]
    assert hard_format_reward(None, responses, [8] * 6) == [0.5, 0.0, 0.0, 0.5, 0.5, 0.0]


def test_mark_reward_counts_each_mark_once():
    assert mark_num(PERFECT) == 0.5
    assert mark_num("<think>\n") == 0.125
    assert mark_num("<think>\n</think>\n") == 0.25
    assert mark_num("<think>\n<think>\n</think>\n") == 0.125  # a duplicate mark earns nothing
    assert mark_num("<think></think><answer></answer>") == 0.0  # marks need their newline
    assert mark_reward(None, [PERFECT, "", "<answer>\n</answer>\n"], [0] * 3) == [0.5, 0.0, 0.25]


def test_all_rewards_of_a_perfect_answer_sum_to_3_5():
    total = sum(f(None, [PERFECT], [8])[0] for f in (correctness_reward, digit_reward, hard_format_reward, mark_reward))
    assert total == 3.5


def test_soft_overlong_punishment_eq13():
    # L_max = 100, L_cache = 20: free up to 80 tokens, linear to -1 at 100, -1 beyond.
    lengths = torch.tensor([10, 80, 81, 90, 100, 120])
    values = soft_overlong_punishment(lengths, max_length=100, cache_length=20)
    assert values.dtype == torch.float32 and values.shape == (6,)
    assert values.tolist() == pytest.approx([0.0, 0.0, -0.05, -0.5, -1.0, -1.0], abs=1e-7)
    scaled = soft_overlong_punishment(torch.tensor([90]), max_length=100, cache_length=20, penalty_factor=0.5)
    assert math.isclose(scaled.item(), -0.25)
