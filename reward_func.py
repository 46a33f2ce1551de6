"""Reward functions for DAPO on GSM8K-style math.

Every reward has the signature `(prompts, responses, answers) -> list[float]` (one value per
response; `None` means "no opinion" and is ignored by the trainer). They form a curriculum
from soft to hard, so that a model gets a learning signal before it can solve anything:

    reward               max    kind           purpose
    correctness_reward   2.0    sparse, hard   the last number in <answer> equals the answer (as numbers)
    digit_reward         0.5    dense          the extracted answer is a plain integer
    hard_format_reward   0.5    sparse, hard   the whole response is <think>..</think><answer>..</answer>
    mark_reward          0.5    dense, soft    0.125 for each tag+newline that occurs exactly once
"""

import math
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from time_limits import TimeLimitExpired, time_limit

ANSWER_REGEX = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The seed's number regex was r"\d+\.\d+|\d+/\d+|\d+" (decimal | fraction | integer). It also
# reads a sign and thousands separators, so that "-3" is not "3" and "1,234" is not "234":
#   - a minus sign (ASCII "-", U+2212 "−", full-width "－") when it is not right after a digit,
#     a Latin letter or a closing bracket ("5-3" is a subtraction, "x-3" an expression: "3");
#   - ASCII commas between groups of exactly three digits, the first group of one to three
#     digits, optionally a decimal part: "1,234", "12,345.5". The group must be the whole run:
#     it does not start right after "digit," or "digit/" and is not followed by a digit,
#     ",digit", ".digit" or "/digit" ("3,4,567", "1,2345" and "1,234/5" read as the seed reads
#     them). The full-width comma "，" is not a separator: in Chinese text it separates clauses
#     and list items ("3，4" is two numbers), and models write thousands with an ASCII comma.
NUMBER_REGEX = re.compile(
    r"(?:(?<![0-9A-Za-z)\]])[-\u2212\uff0d])?"  # optional sign
    r"(?:(?<!\d[,/])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|[,./]\d)"  # 1,234 or 1,234.5
    r"|\d+\.\d+|\d+/\d+|\d+)"  # the seed's decimal | fraction | integer, in that priority
)
INTEGER_REGEX = re.compile(r"[-\u2212\uff0d]?(?:\d{1,3}(?:,\d{3})+|\d+)")  # what digit_reward accepts
# Where a final answer is announced, for the lenient rule: Chinese (最终答案, 答案 with 是 / 为 / ：, 答： as a
# written solution ends), English ("the final answer is", "Answer:"), GSM8K's "####" and LaTeX's \boxed{.
ANSWER_PHRASE_REGEX = re.compile(
    r"最终答案|答案|答\s*[:：]|(?:the\s+)?(?:final\s+)?(?<![</])answer\b|####|\\boxed\{", re.IGNORECASE
)
STRICT_FORMAT_REGEX = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\n$", re.DOTALL)
FORMAT_MARKS = ("<think>\n", "</think>\n", "<answer>\n", "</answer>\n")


def extract_answer(text):
    """The last number inside the first <answer>...</answer> block, as written ("1,234", "-3",
    "5.0", "3/4"); "" if none. `parse_number` gives its value."""
    match = ANSWER_REGEX.search(text)
    if not match:
        return ""
    nums = NUMBER_REGEX.findall(match.group(1))
    return nums[-1].strip() if nums else ""


def parse_number(text):
    """The exact value of a number string as a Fraction, or None if it is not a number.

    Reads what `extract_answer` returns (sign, thousands separators, decimals, fractions a/b)
    and the reference answers' strings ("72", "72.0", "1e3"). Exact: "0.1" is 1/10, "5.0" is
    5, "3/4" is 0.75; a fraction with a zero denominator is None.
    """
    text = str(text).strip().replace("\u2212", "-").replace("\uff0d", "-")
    if INTEGER_REGEX.fullmatch(text) or NUMBER_REGEX.fullmatch(text):
        text = text.replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


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


def extract_answer_lenient(text):
    """The final answer found anywhere in the response (the lenient rule of evaluation.py), as written; "" if
    the response holds no number. In this order:

    1. the strict rule: the last number inside the first <answer>...</answer> block (`extract_answer`);
    2. after the last answer phrase that a number follows (ANSWER_PHRASE_REGEX: 最终答案, 答案是 / 答案为 /
       答案：, 答：, "the answer is", "final answer:", "Answer:", GSM8K's "####", \\boxed{...}): the first
       number after it, so that "the answer is 5. Check: 5 + 3 = 8" reads 5;
    3. the last number of the response ("Tom has 12 + 5 = 17 apples" reads 17).
    """
    strict = extract_answer(text)
    if strict:
        return strict
    for phrase in reversed(list(ANSWER_PHRASE_REGEX.finditer(text))):
        number = NUMBER_REGEX.search(text, phrase.end())  # the lookbehinds still see the text before
        if number:
            return number.group().strip()
    numbers = NUMBER_REGEX.findall(text)
    return numbers[-1].strip() if numbers else ""


def same_answer(extracted, answer):
    """Whether an extracted answer equals the reference answer, as numbers.

    Both sides go through `parse_number`, so "5.0", "5" and 5 agree, "1,234" equals 1234, and
    "0.75" equals "3/4" (exact rationals, no float tolerance). When either side is not a number,
    the strings are compared, as the seed compared them. An empty extraction is never correct.
    """
    if not extracted:
        return False
    reference = normalize_answer(answer)
    value, reference_value = parse_number(extracted), parse_number(reference)
    if value is None or reference_value is None:
        return extracted == reference
    return value == reference_value


def is_correct(response, answer):
    """Whether the number in the response's answer tags equals the reference answer (`same_answer`): the seed's
    rule, which `correctness_reward`, the trainer's evaluation and evaluation.py's strict accuracy use."""
    return same_answer(extract_answer(response), answer)


def is_correct_lenient(response, answer):
    """Whether the final answer found anywhere in the response (`extract_answer_lenient`) is right."""
    return same_answer(extract_answer_lenient(response), answer)


@dataclass(frozen=True)
class AnswerChecker:
    """How answers are read and compared (--answer_checker): `extract` is the strict rule (inside the answer tags),
    `extract_lenient` finds a final answer anywhere, `same(extracted, reference answer)` compares. The seed's is
    NUMBER_CHECKER; math_checker.MATH_VERIFY_CHECKER compares with math-verify. Strict and lenient accuracy and
    correctness_reward all use the run's one checker."""

    name: str
    extract: Callable[[str], str]
    extract_lenient: Callable[[str], str]
    same: Callable[[str, object], bool]

    def is_correct(self, response, answer):
        return self.same(self.extract(response), answer)


NUMBER_CHECKER = AnswerChecker("number", extract_answer, extract_answer_lenient, same_answer)


def mark_num(text):
    """0.125 for each of the four tag+newline strings that occurs exactly once (max 0.5)."""
    return sum(0.125 for mark in FORMAT_MARKS if text.count(mark) == 1)


def correctness_reward(prompts, responses, answers, checker=None):
    """2.0 when the extracted answer equals the reference answer as a number (`is_correct`), else 0.0. checker:
    another AnswerChecker (--answer_checker=math_verify binds math_checker's: user_rewards.reward_functions)."""
    correct = is_correct if checker is None else checker.is_correct
    return [2.0 if correct(response, answer) else 0.0 for response, answer in zip(responses, answers)]


def digit_reward(prompts, responses, answers):
    """0.5 when the extracted answer is a plain integer, else 0.0.

    A plain integer: digits, optionally a minus sign and thousands separators ("72", "-3",
    "1,234"); not "5.0", "3.75" or "3/4". The seed's `.isdigit()` saw "-3" as "3" and "1,234"
    as "234" (both 0.5), so the values equal the seed's for every response.
    """
    return [0.5 if INTEGER_REGEX.fullmatch(extract_answer(response)) else 0.0 for response in responses]


def hard_format_reward(prompts, responses, answers):
    """0.5 when the whole response matches the strict think/answer layout, else 0.0."""
    return [0.5 if STRICT_FORMAT_REGEX.match(response) else 0.0 for response in responses]


def mark_reward(prompts, responses, answers):
    """Soft format reward in [0, 0.5]: see `mark_num`."""
    return [mark_num(response) for response in responses]


# ---- reward models: a sequence-classification model (or its path) in place of a function ----
def reward_weight_tensor(weights, num_funcs, device):
    """[F] float32: one weight per reward function (None: all 1.0); another count is refused."""
    weights = list(weights) if weights else [1.0] * num_funcs
    if len(weights) != num_funcs:
        raise ValueError(f"reward_weights has {len(weights)} entries but there are {num_funcs} reward functions")
    return torch.tensor(weights, dtype=torch.float32, device=device)


def load_reward_models(reward_funcs, reward_tokenizers, device):
    """Reward functions as given, with paths loaded as AutoModelForSequenceClassification (one label) and a
    tokenizer for each model (its own, unless given). Returns (reward_funcs, reward_tokenizers) lists."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

    single = isinstance(reward_funcs, (str, PreTrainedModel)) or callable(reward_funcs)
    reward_funcs = [reward_funcs] if single else list(reward_funcs or [])
    if not reward_funcs:
        raise ValueError("DapoTrainer needs at least one reward function")
    if (
        reward_tokenizers is None
        or isinstance(reward_tokenizers, str)
        or not isinstance(reward_tokenizers, (list, tuple))
    ):
        reward_tokenizers = [reward_tokenizers] * (len(reward_funcs) if reward_tokenizers is None else 1)
    if len(reward_tokenizers) != len(reward_funcs):
        raise ValueError("reward_tokenizers must have one entry per reward function")
    reward_tokenizers = list(reward_tokenizers)
    for i, reward_func in enumerate(reward_funcs):
        if isinstance(reward_func, str):
            reward_func = AutoModelForSequenceClassification.from_pretrained(reward_func, num_labels=1)
        if isinstance(reward_func, PreTrainedModel):
            reward_funcs[i] = reward_func = reward_func.to(device).eval()
            tokenizer = reward_tokenizers[i] or reward_func.config._name_or_path
            tokenizer = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, str) else tokenizer
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            reward_func.config.pad_token_id = tokenizer.pad_token_id
            reward_tokenizers[i] = tokenizer
    return reward_funcs, reward_tokenizers


def reward_model_scores(model, tokenizer, prompts, responses):
    """The model's score of each prompt + response: [N] float32."""
    texts = [p + r for p, r in zip(prompts, responses)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
    return model(**inputs).logits[:, 0].float()


class RewardFunctionError(RuntimeError):
    """A reward function (or model) raised. The message names it; its own traceback is the cause's, which
    train.py's main lets through (it turns only the trainer's own errors into one line)."""


class RewardTimeoutError(ValueError):
    """A reward function ran past reward_timeout: one line (train.py's main), naming it."""


class RewardCallExpired(TimeLimitExpired):
    """A reward function's call ran past reward_timeout."""


# Answer checks (math_checker's) that raised or ran past their limit in this process: {"raised": n, "timed_out": n}.
# reward_column counts the ones made during each reward function's call, per function, for metrics.jsonl.
CHECK_FAILURES = Counter()


def reward_column(name, reward_func, reward_tokenizer, prompts, responses, answers, device, timeout=0, failures=None):
    """One reward function's (or reward model's) scores of N responses: [N] float32, NaN where it returned None
    (no opinion). A wrong number of values, a NaN or infinite one, or a call past `timeout` seconds (0: no limit)
    is an error that names the function. failures: {metric: count}, to which the answer checks that raised or
    ran past their limit during the call add, as reward_errors/NAME and reward_timeouts/NAME."""
    checks_before = CHECK_FAILURES.copy()
    try:
        with time_limit(timeout, RewardCallExpired):
            if reward_tokenizer is not None:  # a reward model, scoring prompt + response
                return reward_model_scores(reward_func, reward_tokenizer, prompts, responses)
            values = list(reward_func(prompts=prompts, responses=responses, answers=answers))
    except RewardCallExpired:
        message = f"reward function {name} ran past reward_timeout={timeout} s on {len(responses)} responses"
        raise RewardTimeoutError(f"{message}: make it faster, or raise reward_timeout (0 = no limit)") from None
    except Exception as error:  # the user's code: name it, keep its traceback
        raise RewardFunctionError(f"reward function {name} raised {type(error).__name__}: {error}") from error
    if failures is not None:
        for kind, metric in (("raised", "reward_errors"), ("timed_out", "reward_timeouts")):
            failures[f"{metric}/{name}"] = (
                failures.get(f"{metric}/{name}", 0) + CHECK_FAILURES[kind] - checks_before[kind]
            )
    if len(values) != len(responses):
        raise ValueError(f"reward function {name} returned {len(values)} values for {len(responses)} responses")
    given, values = values, [math.nan if v is None else float(v) for v in values]
    for i, (v, value) in enumerate(zip(given, values)):
        if v is not None and not math.isfinite(value):
            kind = "a NaN" if math.isnan(value) else "an infinite"
            raise ValueError(
                f"reward function {name} gave response {i} of {len(values)} {kind} reward; return None for no opinion"
            )
    return torch.tensor(values, dtype=torch.float32, device=device)


def example_records(prompts, responses, answers, rewards, reward_names, extract=extract_answer):
    """Responses as samples.jsonl records: prompt, response, extracted and reference answer, and what each reward
    function gave (rewards [N, F]; None where it had no opinion)."""
    return [
        {
            "prompt": prompt,
            "response": response,
            "extracted_answer": extract(response),
            "answer": normalize_answer(answer),
            "rewards": {name: None if math.isnan(v) else v for name, v in zip(reward_names, row.tolist())},
        }
        for prompt, response, answer, row in zip(prompts, responses, answers, rewards)
    ]


def reward_func_name(reward_func):
    if hasattr(reward_func, "config"):  # a reward model: its folder's name
        return reward_func.config._name_or_path.rstrip("/").split("/")[-1] or "reward_model"
    return getattr(reward_func, "__name__", type(reward_func).__name__)
