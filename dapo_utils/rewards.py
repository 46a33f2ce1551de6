"""Running the reward functions: --reward_funcs resolved to functions (reward_func.py's names, or `module:function`
import paths of your own), reward models in place of functions, one function's scores of a batch checked and
named when they go wrong (reward_column), the answer checker of --answer_checker, and --check_rewards, which scores
every reference answer as a perfect response before a run, so that answers the rewards cannot read show at once
rather than as a run of zeros.

A reward function takes (prompts, responses, answers) as keywords and returns one float per response (None: no
opinion), as reward_func.py's do; one that also takes `checker=` gets the run's AnswerChecker. my_rewards.py, in a
folder on sys.path (the working directory, or PYTHONPATH):

    def brevity(prompts, responses, answers):
        return [0.5 if len(response) < 400 else 0.0 for response in responses]

    python train.py --reward_funcs=correctness_reward,my_rewards:brevity --reward_weights=1,0.5
"""

import functools
import importlib
import inspect
import math
import os
import traceback

import torch

from dapo_utils.answers import CHECK_FAILURES, NUMBER_CHECKER, extract_answer, normalize_answer
from dapo_utils.data import GSM8KDataset
from dapo_utils.time_limits import TimeLimitExpired, time_limit

SHOWN_FAILURES = 5  # rows that --check_rewards prints of those short of full marks
CHUNK = 256  # responses per reward call in --check_rewards


def answer_checker(name):
    """The AnswerChecker of --answer_checker: the seed's number rule, or math-verify's (imported only then)."""
    if name == "math_verify":
        from dapo_utils.math_checker import MATH_VERIFY_CHECKER

        return MATH_VERIFY_CHECKER
    return NUMBER_CHECKER


def reward_functions(args, home, trial=None):
    """The functions of args.reward_funcs (comma-separated names), each resolved and checked (resolve): a bare name
    is a function of the module `home` (train.py passes reward_func), `module:function` any importable one. With
    --answer_checker=math_verify, a function that takes `checker=` (correctness_reward) compares with it. trial: a
    data set whose first two rows each function scores as perfect responses, so that one returning the wrong
    count, a NaN or infinite value, or running past reward_timeout is refused before training. Errors: ValueError,
    one line naming the function."""
    checker = answer_checker(args.answer_checker)
    names = [name.strip() for name in args.reward_funcs.split(",") if name.strip()]
    if not names:
        raise ValueError(f"reward_funcs names no function: give functions of {home.__name__}.py or module:function")
    funcs = [resolve(name, home) for name in names]
    if checker is not NUMBER_CHECKER:  # the seed's function, with another way to compare answers
        bind = lambda f: functools.update_wrapper(functools.partial(f, checker=checker), f)  # noqa: E731
        funcs = [bind(f) if "checker" in inspect.signature(f).parameters else f for f in funcs]
    if trial is not None:
        rows = [trial[i] for i in range(min(2, len(trial)))]
        prompts, answers = [row["prompt"] for row in rows], [row["answer"] for row in rows]
        for func in funcs:
            name, responses = reward_func_name(func), [perfect_response(answer) for answer in answers]
            reward_column(name, func, None, prompts, responses, answers, "cpu", args.reward_timeout)
    return funcs


def resolve(name, home):
    """A reward function by its name in the module `home` or its `module:function` path, checked to be a function
    of (prompts, responses, answers)."""
    module_name, _, attribute = name.rpartition(":")
    own = f"give your own as module:function (its module on sys.path), or a function of {home.__name__}.py"
    try:
        module = importlib.import_module(module_name) if module_name else home
    except Exception as error:  # noqa: BLE001 - not found, or the module's own error: one line either way
        raise ValueError(f"reward function {name!r}: cannot import {module_name!r} ({error}); {own}") from None
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"reward function {name!r}: {module.__name__} has no function {attribute!r}; {own}")
    try:
        inspect.signature(func).bind(prompts=[], responses=[], answers=[])
    except TypeError:
        raise ValueError(
            f"reward function {name!r} takes {inspect.signature(func)}; a reward function takes (prompts, responses, "
            "answers) and returns one float per response (None: no opinion)"
        ) from None
    return func


def perfect_response(answer):
    """A response in the format the system prompt asks for, with the reference answer as its answer."""
    return f"<think>\n...\n</think>\n<answer>\n{normalize_answer(answer)}\n</answer>\n"


def check_rewards(args, reward_funcs):
    """--check_rewards: every reference answer of the train and test splits, written as a perfect response, scored
    by each reward function and the answer checker. Prints how many get full marks (the checker's "correct" and
    every function at the best value it gave any row) and the first rows that fall short. Returns the exit status:
    0 when every row gets full marks, else 1."""
    checker, names = answer_checker(args.answer_checker), [reward_func_name(f) for f in reward_funcs]
    rows = reference_rows(args)  # (split, row in the split, question, answer)
    answers = [answer for *_, answer in rows]
    responses = [perfect_response(answer) for answer in answers]
    scores = perfect_scores(names, reward_funcs, rows, responses, args.reward_timeout)  # {name: [value per row]}
    correct = [checker.is_correct(response, answer) for response, answer in zip(responses, answers)]
    seen = {name: [v for v in values if not math.isnan(v)] or [math.nan] for name, values in scores.items()}
    best, low = {n: max(values) for n, values in seen.items()}, {n: min(values) for n, values in seen.items()}
    short = [[name for name in names if scores[name][i] != best[name]] for i in range(len(rows))]  # None: short
    failures = [i for i in range(len(rows)) if short[i] or not correct[i]]
    splits = ", ".join(f"{sum(row[0] == split for row in rows)} {split}" for split in ("train", "test"))
    print(f"check_rewards: {splits} reference answers of {args.data_path!r}, each as the perfect response")
    print(f"  {responses[0]!r}")
    print(f"  answer checker {checker.name}: {sum(correct)} of {len(rows)} correct")
    for name in names:
        at_best = sum(value == best[name] for value in scores[name])
        zero = "  (0 for every perfect response: does it read these answers?)" if best[name] == low[name] == 0 else ""
        print(f"  {name}: {at_best} of {len(rows)} at its best, {best[name]:g} (lowest {low[name]:g}){zero}")
    print(f"full marks: {len(rows) - len(failures)} of {len(rows)}")
    for i in failures[:SHOWN_FAILURES]:
        split, row, question, answer = rows[i]
        why = ([] if correct[i] else ["the answer checker says wrong"]) + [
            f"{name} {scores[name][i]:g} of {best[name]:g}" for name in short[i]
        ]
        print(f"  {split} row {row}: answer {normalize_answer(answer)!r} ({question[:40]!r}...): {'; '.join(why)}")
    return 1 if failures else 0


def reference_rows(args):
    """(split, row in the split, question, reference answer) of the train and test splits, read as training reads
    them (the held-out rule included)."""
    reading = dict(columns=(args.question_column, args.answer_column), answer_format=args.answer_format)
    reading["test_size"] = args.test_size
    rows = []
    for split in ("train", "test"):
        data = GSM8KDataset(args.data_path, None, split, **reading)
        rows += [(split, i, item["prompt"], item["answer"]) for i, item in enumerate(data)]
    return rows


def perfect_scores(names, reward_funcs, rows, responses, timeout):
    """{name: [its value for each row's perfect response]} (NaN for None), CHUNK responses per call."""
    scores = {name: [] for name in names}
    prompts, answers = [row[2] for row in rows], [row[3] for row in rows]
    for start in range(0, len(rows), CHUNK):
        part = slice(start, start + CHUNK)
        for name, func in zip(names, reward_funcs):
            values = reward_column(name, func, None, prompts[part], responses[part], answers[part], "cpu", timeout)
            scores[name] += values.tolist()
    return scores


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


class RewardFunctionError(ValueError):
    """A reward function (or model) that raised or returned what is no reward (a string, the wrong count, a NaN).
    The message is one line naming it, what it did and, when it raised, the file and line of the user's code that
    did; the original error is the cause. launch.main adds the checkpoint to resume (--debug: the traceback)."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function ran past reward_timeout: one line (launch.main), naming it."""


class RewardCallExpired(TimeLimitExpired):
    """A reward function's call ran past reward_timeout."""


def raised_at(error, func):
    """Where an exception raised in a reward function came from, as `file:line`: the last frame in the function's own
    module (the user's code, not a library it called), else the last frame; paths under the working directory
    relative to it."""
    frames = traceback.extract_tb(error.__traceback__)
    code = getattr(inspect.unwrap(getattr(func, "func", func)), "__code__", None)  # a partial: its function
    own = [frame for frame in frames if code is not None and frame.filename == code.co_filename]
    frame = (own or frames)[-1]
    path = (
        os.path.relpath(frame.filename) if not os.path.relpath(frame.filename).startswith(os.pardir) else frame.filename
    )
    return f"{path}:{frame.lineno}"


def reward_column(name, reward_func, reward_tokenizer, prompts, responses, answers, device, timeout=0, failures=None):
    """One reward function's (or reward model's) scores of N responses: [N] float32, NaN where it returned None
    (no opinion). An exception it raises, a value that is no number, a wrong number of values, a NaN or infinite
    one, or a call past `timeout` seconds (0: no limit) is a RewardFunctionError that names the function.
    failures: {metric: count}, to which the answer checks that raised or ran past their limit during the call
    add, as reward_errors/NAME and reward_timeouts/NAME."""
    checks_before = CHECK_FAILURES.copy()
    try:
        with time_limit(timeout, RewardCallExpired):
            if reward_tokenizer is not None:  # a reward model, scoring prompt + response
                return reward_model_scores(reward_func, reward_tokenizer, prompts, responses)
            values = reward_func(prompts=prompts, responses=responses, answers=answers)
    except RewardCallExpired:
        message = f"reward function {name} ran past reward_timeout={timeout} s on {len(responses)} responses"
        raise RewardTimeoutError(f"{message}: make it faster, or raise reward_timeout (0 = no limit)") from None
    except Exception as error:  # the user's code: name it and where it raised, keep its traceback as the cause
        lines = str(error).strip().splitlines() or [""]  # one line: the message's first, the rest in --debug
        what = f"{type(error).__name__}: {lines[0]}{' ...' if len(lines) > 1 else ''} ({raised_at(error, reward_func)})"
        raise RewardFunctionError(f"reward function {name} raised {what}") from error
    if failures is not None:
        for kind, metric in (("raised", "reward_errors"), ("timed_out", "reward_timeouts")):
            failures[f"{metric}/{name}"] = (
                failures.get(f"{metric}/{name}", 0) + CHECK_FAILURES[kind] - checks_before[kind]
            )
    return torch.tensor(checked_values(name, values, len(responses)), dtype=torch.float32, device=device)


def checked_values(name, values, count):
    """A reward function's return value as `count` floats (NaN for None), or a RewardFunctionError naming the
    function and what is wrong: not a list, the wrong count, a value that is no number, a NaN or infinite one."""
    rule = "return one number per response (None: no opinion)"
    try:
        if isinstance(values, (str, bytes, dict)):
            raise TypeError
        values = list(values)
    except TypeError:
        raise RewardFunctionError(f"reward function {name} returned {short(values)}, not a list: {rule}") from None
    if len(values) != count:
        raise RewardFunctionError(f"reward function {name} returned {len(values)} values for {count} responses")
    floats = []
    for i, value in enumerate(values):
        try:
            if not (value is None or hasattr(value, "__float__")):  # a string too: "high", or "1" by mistake
                raise TypeError
            floats.append(math.nan if value is None else float(value))
        except (TypeError, ValueError):  # a tensor of more than one value: ValueError
            raise RewardFunctionError(
                f"reward function {name} returned {short(value)} for response {i} of {count}: {rule}"
            ) from None
        if value is not None and not math.isfinite(floats[-1]):
            kind = "a NaN" if math.isnan(floats[-1]) else "an infinite"
            raise RewardFunctionError(
                f"reward function {name} gave response {i} of {count} {kind} reward; return None for no opinion"
            )
    return floats


def short(value):
    """A value in a message: its repr, cut to 40 characters, and its type."""
    text = repr(value)
    return f"{text[:40]}{'...' if len(text) > 40 else ''} ({type(value).__name__})"


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
