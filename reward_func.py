"""Reward functions for DAPO on GSM8K-style math.

Every reward has the signature `(prompts, responses, answers) -> list[float]` (one value per
response; `None` means "no opinion" and is ignored by the trainer). They form a curriculum
from soft to hard, so that a model gets a learning signal before it can solve anything:

    reward               max    kind           purpose
    correctness_reward   2.0    sparse, hard   the last number in <answer> equals the answer
    digit_reward         0.5    dense          the extracted answer is a plain integer
    hard_format_reward   0.5    sparse, hard   the whole response is <think>..</think><answer>..</answer>
    mark_reward          0.5    dense, soft    0.125 for each tag+newline that occurs exactly once
    soft_overlong_punishment  <= 0   length    DAPO Eq. (13); needs response lengths, off by default
"""

import re

ANSWER_REGEX = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_REGEX = re.compile(r"\d+\.\d+|\d+/\d+|\d+")  # decimal | fraction | integer, in that priority
STRICT_FORMAT_REGEX = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\n$", re.DOTALL)
FORMAT_MARKS = ("<think>\n", "</think>\n", "<answer>\n", "</answer>\n")


def extract_answer(text):
    """The last number inside the first <answer>...</answer> block, as a string; "" if none."""
    match = ANSWER_REGEX.search(text)
    if not match:
        return ""
    nums = NUMBER_REGEX.findall(match.group(1))
    return nums[-1].strip() if nums else ""


def normalize_answer(answer):
    """The reference answer as the seed's `str(ans.item())` prints an integer answer.

    A DataLoader turns the data set's int64 `answer_only` into a 0-d tensor; users also pass
    ints, integral floats (72.0) or strings ("72"). All of them become "72". The seed called
    `.item()` unconditionally and crashed on a str.
    """
    if hasattr(answer, "item"):  # torch / numpy scalar
        answer = answer.item()
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, str):
        answer = answer.strip()
        try:
            as_float = float(answer)
        except ValueError:
            return answer
        return str(int(as_float)) if as_float.is_integer() else answer
    return str(answer)


def mark_num(text):
    """0.125 for each of the four tag+newline strings that occurs exactly once (max 0.5)."""
    return sum(0.125 for mark in FORMAT_MARKS if text.count(mark) == 1)


def correctness_reward(prompts, responses, answers):
    """2.0 when the extracted answer equals the reference answer, else 0.0."""
    return [
        2.0 if extract_answer(response) == normalize_answer(answer) else 0.0
        for response, answer in zip(responses, answers)
    ]


def digit_reward(prompts, responses, answers):
    """0.5 when the extracted answer is all digits (an integer), else 0.0."""
    return [0.5 if extract_answer(response).isdigit() else 0.0 for response in responses]


def hard_format_reward(prompts, responses, answers):
    """0.5 when the whole response matches the strict think/answer layout, else 0.0."""
    return [0.5 if STRICT_FORMAT_REGEX.match(response) else 0.0 for response in responses]


def mark_reward(prompts, responses, answers):
    """Soft format reward in [0, 0.5]: see `mark_num`."""
    return [mark_num(response) for response in responses]


def soft_overlong_punishment(prompts, responses, answers, response_lengths, max_length, cache_length, penalty_factor=1.0):
    """DAPO Eq. (13), counted in response tokens |y| (`response_lengths`, EOS included):

        R(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

    scaled by `penalty_factor` (verl's `overlong_buffer.penalty_factor`). The trainer binds
    `max_length` (L_max), `cache_length` (L_cache) and `penalty_factor` from DapoArguments and
    passes `response_lengths` to any reward function that declares that parameter.
    """
    expected = max_length - cache_length
    return [
        penalty_factor * max(-1.0, min(0.0, (expected - float(length)) / cache_length))
        for length in response_lengths
    ]
