"""Every reward branch with its exact value (the seed's numbers, and where numbers differ, why)."""

import math
import random
import re
from fractions import Fraction

import pytest
import torch

from dapo_utils.answers import extract_answer, is_correct, normalize_answer, parse_number
from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_num, mark_reward
from train import soft_overlong_punishment

PERFECT = "<think>\n3+5=8\n</think>\n<answer>\n8\n</answer>\n"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>72</answer>", "72"),
        ("<answer>\n答案是 3.75 元\n</answer>", "3.75"),
        ("<answer>3/4</answer>", "3/4"),
        ("<answer>先算 12 再算 30，最后 42</answer>", "42"),  # the last number
        ("<answer>1,000</answer>", "1,000"),  # thousands separators (the seed: "000")
        ("<answer>12,345,678.5</answer>", "12,345,678.5"),
        ("<answer>-5</answer>", "-5"),  # a sign (the seed: "5")
        ("<answer>答案是−5</answer>", "−5"),  # U+2212 after a CJK character
        ("<answer>－5</answer>", "－5"),  # full-width minus
        ("<answer>-3/4</answer>", "-3/4"),
        ("<answer>8-5</answer>", "5"),  # after a digit "-" is a subtraction
        ("<answer>x-5</answer>", "5"),  # ... and after a letter or ")"
        ("<answer>(8)-5</answer>", "5"),
        ("<answer>3,4,567</answer>", "567"),  # not a thousands group: a list
        ("<answer>1,2345</answer>", "2345"),  # not groups of three
        ("<answer>1,234/5</answer>", "234/5"),  # the fraction wins, as in the seed
        ("<answer>3，456</answer>", "456"),  # the full-width comma separates Chinese list items
        ("<answer>5.0</answer>", "5.0"),
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
    responses = [
        "<answer>72</answer>",
        "<answer>71</answer>",
        "no tag",
        "<answer>72.0</answer>",
        "<answer>72/1</answer>",
    ]
    for answer in (torch.tensor(72), 72, 72.0, "72", "72.0"):
        assert correctness_reward(None, responses, [answer] * 5) == [2.0, 0.0, 0.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "text, value",
    [
        ("72", Fraction(72)),
        ("1,234", Fraction(1234)),
        ("-1,234.5", Fraction(-2469, 2)),
        ("−3", Fraction(-3)),
        ("－3", Fraction(-3)),
        ("5.0", Fraction(5)),
        ("0.1", Fraction(1, 10)),  # exact, not the float 0.1
        ("3/4", Fraction(3, 4)),
        ("1e-07", Fraction(1, 10**7)),  # str() of a small float reference answer
        ("3/0", None),
        ("1,2", None),
        ("", None),
        ("abc", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "body, answer, correct",
    [
        ("5.0", 5, True),
        ("5.00", torch.tensor(5), True),
        ("1,234", 1234, True),
        ("1,234", 234, False),  # the seed: True ("234")
        ("-3", -3, True),  # the seed: False ("3" != "-3")
        ("-3", 3, False),  # the seed: True
        ("答案是−3", torch.tensor(-3), True),
        ("0.75", "3/4", True),  # exact rationals
        ("3/4", 0.75, True),
        ("0.3", 0.1 + 0.2, False),  # 0.30000000000000004 is not 0.3: no float tolerance
        ("1/3", "0.333", False),
        ("3/0", "3/0", True),  # not numbers: compared as strings, as the seed did
        ("", "", False),  # nothing extracted is never correct
    ],
)
def test_is_correct_compares_numbers_exactly(body, answer, correct):
    response = f"<answer>{body}</answer>"
    assert is_correct(response, answer) is correct
    assert correctness_reward(None, [response], [answer]) == [2.0 if correct else 0.0]


def test_digit_reward():
    bodies = ["72", "3.5", "3/4", "x", "-3", "−3", "1,234", "-1,234", "5.0", "1,234.0", "-3/4"]
    responses = [f"<answer>{body}</answer>" for body in bodies] + ["72"]
    assert digit_reward(None, responses, [0] * 12) == [0.5, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0]


# The seed's extraction, verbatim, to compare against.
SEED_NUMBER_REGEX = re.compile(r"\d+\.\d+|\d+/\d+|\d+")


def seed_extract_answer(text):
    match = re.search(r"<answer>(.*?)<\/answer>", text, re.DOTALL)
    if not match or not match.group(1):
        return ""
    nums = SEED_NUMBER_REGEX.findall(match.group(1))
    return nums[-1].strip() if nums else ""


def seed_rewards(response, answer):
    """The seed's (correctness, digit) rewards; str(answer) is its str(ans.item()) for a tensor."""
    extracted = seed_extract_answer(response)
    return (2.0 if extracted == str(answer) else 0.0, 0.5 if extracted.isdigit() else 0.0)


def new_rewards(response, answer):
    return (correctness_reward(None, [response], [answer])[0], digit_reward(None, [response], [answer])[0])


# The kinds of responses whose default rewards differ from the seed's (only correctness changes):
# (answer block, reference answer, seed's (correctness, digit), here (correctness, digit)).
CHANGED_DEFAULT_REWARDS = [
    ("1,234", 1234, (0.0, 0.5), (2.0, 0.5)),  # the seed read "234"
    ("1,234", 234, (2.0, 0.5), (0.0, 0.5)),
    ("-1,234", -1234, (0.0, 0.5), (2.0, 0.5)),
    ("-3", -3, (0.0, 0.5), (2.0, 0.5)),  # the seed read "3"
    ("-3", 3, (2.0, 0.5), (0.0, 0.5)),
    ("答案是 −3 度", -3, (0.0, 0.5), (2.0, 0.5)),
    ("5.0", 5, (0.0, 0.0), (2.0, 0.0)),  # "5.0" != "5" in the seed
    ("5/1", 5, (0.0, 0.0), (2.0, 0.0)),
    ("0.75", "3/4", (0.0, 0.0), (2.0, 0.0)),
]


@pytest.mark.parametrize("body, answer, seed, here", CHANGED_DEFAULT_REWARDS)
def test_changes_to_the_seeds_default_rewards(body, answer, seed, here):
    response = f"<think>\n...\n</think>\n<answer>\n{body}\n</answer>\n"
    assert seed != here
    assert seed_rewards(response, answer) == seed
    assert new_rewards(response, answer) == here
    # hard_format_reward and mark_reward do not read the answer: 0.5 + 0.5 in both.
    assert hard_format_reward(None, [response], [answer]) == [0.5] and mark_reward(None, [response], [answer]) == [0.5]


def test_digit_reward_equals_the_seeds_on_random_answers():
    # Random answer blocks of digits, separators, signs and letters: digit_reward is the seed's
    # everywhere, and the seed's extraction is the tail of the new one (a sign or a thousands
    # group added in front), so the seed's number is never read differently, only extended.
    rng = random.Random(0)
    alphabet = "0123456789" * 3 + ",,,..//--−－ a)，x"
    for _ in range(20000):
        response = "<answer>" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) + "</answer>"
        seed, new = seed_extract_answer(response), extract_answer(response)
        assert digit_reward(None, [response], [0]) == [0.5 if seed.isdigit() else 0.0], response
        assert (seed == "") == (new == "") and new.replace(",", "").lstrip("-−－").endswith(seed), response


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
