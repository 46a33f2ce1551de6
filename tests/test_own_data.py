"""Your own data, prompt and rewards (issue 32) and the rows check: each through train.py's command line and the
real loader; every refusal is one line, before a model loads."""

import json
import math
import os
import shlex
import subprocess
import sys
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import reward_func
import train
from dapo_utils import checkpoints, tiny_world
from dapo_utils.answers import is_correct
from dapo_utils.curves import read_jsonl, read_step_log
from dapo_utils.evaluation import problem_record
from dapo_utils.rewards import perfect_response, reward_functions
from dapo_utils.options import run_command
from test_docs import ROOT, shell_scripts
from train import GSM8KDataset, build_args, main

# docs/own-data.md's English prompt: the seed's <think>/<answer> format, in English
ENGLISH_PROMPT = (
    "\nAnswer in the following format:\n<think>\nyour reasoning\n</think>\n<answer>\nyour answer\n</answer>\n"
)
SMALL_RL = ["--device=cpu", "--lr=3e-4", "--max_grad_norm=1.0", "--num_generations=4", "--batch_size=2"]
SMALL_RL += ["--max_generate_length=16", "--eval_steps=100", "--eval_samples=4", "--eval_batch_size=4"]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def demo_world(tmp_path):
    """(model_dir, data_dir) of the demo's world (conftest builds it once per session and copies it)."""
    return tiny_world.build_tiny_world(
        str(tmp_path / "world"), train.SYSTEM_PROMPT, warm_up_steps=tiny_world.DEMO_WARM_UP_STEPS
    )


def english_gsm8k(data_dir, folder, num_train, num_test):
    """The demo world's problems as English GSM8K: question / answer with the solution ending '#### c', JSONL."""
    data = datasets.load_dataset(data_dir)
    for split, n in (("train", num_train), ("test", num_test)):
        rows = [{"question": r["question"], "answer": r["answer"]} for r in data[split].select(range(n))]
        write_jsonl(folder / f"{split}.jsonl", rows)
    return data


def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(checkpoints, "load_causal_lm", refuse)  # DapoTrainer loads model_path


def refusal(argv):
    """The line main exits with (asserted to be one line)."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    message = str(stopped.value.code)
    assert "\n" not in message, message
    return message


# ---------- data and prompt ----------
def test_english_gsm8k_jsonl_and_a_prompt_file_train_the_demo_model(tmp_path):
    model_dir, data_dir = demo_world(tmp_path)
    data = english_gsm8k(data_dir, tmp_path / "english", num_train=64, num_test=8)
    prompt_file = tmp_path / "english_prompt.txt"
    prompt_file.write_text(ENGLISH_PROMPT, encoding="utf-8")
    out = tmp_path / "out"
    trainer = main(
        [f"--model_path={model_dir}", f"--data_path={tmp_path / 'english'}", f"--output_dir={out}", *SMALL_RL]
        + ["--question_column=question", "--answer_column=answer", "--answer_format=gsm8k"]
        + [f"--system_prompt=@{prompt_file}", "--max_steps=3"]
    )
    assert [record["step"] for record in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert trainer.args.system_prompt == ENGLISH_PROMPT  # the file's text, also in the run's dapo_args.json
    assert json.loads((out / "dapo_args.json").read_text(encoding="utf-8"))["system_prompt"] == ENGLISH_PROMPT
    prompt_ids, mask = trainer.encode_prompts([data["test"][0]["question"]])
    expected = tiny_world.chatml_prompt(ENGLISH_PROMPT, data["test"][0]["question"])  # through the demo's tokenizer,
    tokenizer = trainer.tokenizer  # whose vocabulary, learnt from Chinese prompts, lacks some Latin letters
    assert prompt_ids[0][mask[0].bool()].tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
    samples = [s for s in read_jsonl(out / "samples.jsonl") if s["step"] == 0]
    test_rows = {r["question"]: r["answer"] for r in data["test"]}
    assert [s["answer"] for s in samples] == [test_rows[s["prompt"]].split("#### ")[1] for s in samples]
    world = checkpoints.load_causal_lm(model_dir).state_dict()  # the weights moved
    moved = [name for name, value in trainer.model.state_dict().items() if not torch.equal(value, world[name])]
    assert len(moved) > 0


def test_the_five_minute_recipe_runs_as_printed_and_learns(tmp_path):
    """docs/own-data.md's first block, pasted as printed into a shell in a clone after `make demo` with the venv
    activated (its python first on PATH): the demo's problems written to JSONL under other column names, then a run
    on the demo's model that reads them by those names, with the demo's settings: its held-out accuracy climbs."""
    page = os.path.join(ROOT, "docs/own-data.md")
    with open(page, encoding="utf-8") as f:
        (script,) = [text for before, text in shell_scripts(f.read()) if "test_the_five_minute_recipe" in before]
    clone = tmp_path / "clone"  # the scripts and the package of this checkout, and what `make demo` leaves
    (clone / "output" / "demo").mkdir(parents=True)
    for name in ("train.py", "reward_func.py", "dapo_utils"):
        (clone / name).symlink_to(os.path.join(ROOT, name))
    tiny_world.demo_world(str(clone / "output" / "demo"), train.SYSTEM_PROMPT)  # conftest builds it once a session
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    ran = subprocess.run(["bash", "-ec", script], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = read_jsonl(clone / "my_data" / "test.jsonl")
    assert len(rows) == tiny_world.DEMO_NUM_TEST and set(rows[0]) == {"problem", "solution"}
    accuracy = read_step_log(str(clone / "output" / "my_data" / "accuracy_losses.txt"))
    assert sorted(accuracy) == [0, 20, 40], accuracy  # 0.22 -> 0.48 on an AVX-512 Xeon: the demo's first 40 steps,
    assert accuracy[40] - accuracy[0] >= 0.05, accuracy  # which gain +0.12 to +0.29 over demo.md's six seeds
    assert f"step 0 {accuracy[0]:.2f} / {accuracy[0]:.2f}  ->  step 40 {accuracy[40]:.2f} /" in ran.stdout


def test_a_file_a_save_to_disk_folder_and_a_csv_read_like_the_seeds_folder(world, tmp_path):
    _, data_dir = world
    rows = datasets.load_dataset(data_dir)["train"]  # 32 rows
    rows.to_json(str(tmp_path / "train.jsonl"), force_ascii=False)
    rows.to_csv(str(tmp_path / "train.csv"), index=False)
    rows.save_to_disk(str(tmp_path / "saved"))  # a Dataset: its rows are "train"
    held_out = rows.train_test_split(test_size=5, seed=0)  # today's rule for a data set without a test split
    expected = {split: [(r["question_zh-cn"], r["answer_only"]) for r in held_out[split]] for split in held_out}
    for path in ("train.jsonl", "train.csv", "saved"):
        for split in ("train", "test"):
            read = GSM8KDataset(str(tmp_path / path), None, split, test_size=5)
            assert [(item["prompt"], item["answer"]) for item in read] == expected[split], (path, split)
    gsm8k = GSM8KDataset(str(tmp_path / "train.jsonl"), None, "train", 0, ("question", "answer"), "gsm8k")
    assert [gsm8k[i]["answer"] for i in range(len(rows))] == [str(r["answer_only"]) for r in rows]


# ---------- rewards ----------
OWN_REWARDS = """
import math
import time

CALLS = []


def answer_length(prompts, responses, answers):
    CALLS.append((list(prompts), list(responses), [str(getattr(a, "item", lambda: a)()) for a in answers]))
    return [float(len(response) % 3) for response in responses]


def trl_style(completions, **kwargs):
    return [0.0 for _ in completions]


def one_value(prompts, responses, answers):
    return [1.0]


def nan_second(prompts, responses, answers):
    return [0.0, math.nan][: len(responses)]


def slow(prompts, responses, answers):
    time.sleep(30)
"""


@pytest.fixture
def own_rewards(tmp_path, monkeypatch):
    """A user's reward module, own_rewards_32, in a folder on sys.path."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / "own_rewards_32.py").write_text(OWN_REWARDS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "own_rewards_32", raising=False)
    yield
    sys.modules.pop("own_rewards_32", None)


def run_args(world, out, *extra):
    model_dir, data_dir = world
    return [f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={out}", "--device=cpu",
            "--max_generate_length=8", "--eval_samples=4", "--eval_batch_size=4", "--lr=1e-3", *extra]  # fmt: skip


def test_a_user_reward_module_on_sys_path_is_called_with_the_seeds_arguments_and_weighted(world, tmp_path, own_rewards):
    out = tmp_path / "out"
    rewards = ["--reward_funcs=correctness_reward,own_rewards_32:answer_length", "--reward_weights=1,0.5"]
    main(run_args(world, out, "--max_steps=1", "--eval_steps=100", *rewards))
    import own_rewards_32

    test_rows = GSM8KDataset(world[1], None, "test")
    trial = own_rewards_32.CALLS[0]  # before the model loaded: two test rows written as perfect responses
    assert trial == (
        [test_rows[0]["prompt"], test_rows[1]["prompt"]],
        [perfect_response(test_rows[0]["answer"]), perfect_response(test_rows[1]["answer"])],
        [str(test_rows[0]["answer"]), str(test_rows[1]["answer"])],
    )
    train_rows = {row["prompt"]: str(row["answer"]) for row in GSM8KDataset(world[1], None, "train")}
    training = [call for call in own_rewards_32.CALLS[1:] if call[0][0] in train_rows]  # not evaluation's
    assert training and all(len(prompts) % 4 == 0 for prompts, _, _ in training)  # groups of G = 4
    for prompts, _, answers in training:  # each group: one prompt G times, with its reference answer
        assert prompts == [p for p in prompts[::4] for _ in range(4)]
        assert answers == [train_rows[p] for p in prompts]
    scored = [(r, a) for _, responses, answers in training for r, a in zip(responses, answers)]
    expected = sum(2.0 * is_correct(r, a) + 0.5 * (len(r) % 3) for r, a in scored) / len(scored)  # weights 1, 0.5
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert record["reward"] == pytest.approx(expected, abs=1e-6)
    assert record["rewards/answer_length/mean"] == pytest.approx(sum(len(r) % 3 for r, _ in scored) / len(scored))
    assert record["reward_errors/answer_length"] == record["reward_timeouts/correctness_reward"] == 0


def test_each_refusal_is_one_line_before_a_model_loads(world, tmp_path, own_rewards, monkeypatch):
    no_model_loads(monkeypatch)
    out = iter(tmp_path / f"out{i}" for i in range(100))
    lines = {
        "--question_column=problem": "lacks the column(s) ['problem'] of swulling/gsm8k_chinese; it has",
        "--reward_funcs=correctness_reward,no_such_reward": "reward function 'no_such_reward': reward_func has no "
        "function 'no_such_reward'; give your own as module:function",
        "--reward_funcs=no_such_module_32:f": "reward function 'no_such_module_32:f': cannot import 'no_such_module_",
        "--reward_funcs=own_rewards_32:trl_style": "reward function 'own_rewards_32:trl_style' takes (completions, "
        "**kwargs); a reward function takes (prompts, responses, answers)",
        "--reward_funcs=own_rewards_32:one_value": "reward function one_value returned 1 values for 2 responses",
        "--reward_funcs=own_rewards_32:nan_second": "reward function nan_second gave response 1 of 2 a NaN reward; "
        "return None for no opinion",
        "--system_prompt=@no_such_prompt.txt": "system_prompt '@no_such_prompt.txt': cannot read 'no_such_prompt.txt'",
        "--answer_format=latex": "answer_format='latex' needs answer_checker='math_verify'",
    }
    for flag, line in lines.items():
        weights = ["--reward_weights=1"] if flag.startswith("--reward_funcs=own") else []
        assert line in refusal(run_args(world, next(out), flag, *weights)), flag
    argv = run_args(world, next(out), "--reward_funcs=own_rewards_32:slow", "--reward_timeout=0.3")
    assert refusal(argv) == (
        "error: reward function slow ran past reward_timeout=0.3 s on 2 responses: make it faster, or raise "
        "reward_timeout (0 = no limit); there is no checkpoint to resume: fix it, then start the run again with "
        f"{run_command()} {shlex.join(argv)}"
    )


def test_rows_without_a_question_or_a_readable_answer_are_named(world, tmp_path, monkeypatch):
    no_model_loads(monkeypatch)
    model_dir, _ = world
    folder = tmp_path / "holes" / "data"
    folder.mkdir(parents=True)
    questions = pa.array(["q0", None, "  ", "q3", "q4", "q5", "q6"], pa.string())
    answers = pa.array([1.0, 2.0, 3.0, math.nan, 5.0, None, 7.0], pa.float64())
    pq.write_table(pa.table({"question_zh-cn": questions, "answer_only": answers}), folder / "train-0.parquet")
    pq.write_table(pa.table({"question_zh-cn": ["q"], "answer_only": [1.0]}), folder / "test-0.parquet")
    where = f"split 'train' of {str(tmp_path / 'holes')!r}"
    assert refusal(run_args((model_dir, str(tmp_path / "holes")), tmp_path / "a")) == (
        f"error: {where} has no question_zh-cn in rows [1, 2]; has no answer_only in rows [3, 5]: fill or drop them"
    )
    rows = [{"question": "q0", "answer": "2 + 1 = 3\n#### 3"}, {"question": "q1", "answer": "three"}]
    rows += [{"question": "q2", "answer": "#### 1,234"}, {"question": "q3", "answer": "#### x"}]
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    flags = ["--question_column=question", "--answer_column=answer", "--answer_format=gsm8k"]
    assert refusal(run_args((model_dir, str(gsm8k)), tmp_path / "b", *flags)) == (
        f"error: split 'train' of {str(gsm8k)!r} has answers in answer that --answer_format=gsm8k cannot read in "
        "rows [1, 3] ('three', '#### x'): fix them or choose another --answer_format (number; gsm8k: the number "
        "after '####'; latex)"
    )


def test_a_nan_reward_during_training_names_the_function_and_the_response(make_trainer):
    from conftest import make_batch

    def nan_at_2(prompts, responses, answers):  # None (no opinion) elsewhere is fine
        return [math.nan if i == 2 else None for i in range(len(responses))]

    trainer = make_trainer(reward_funcs=[nan_at_2])
    with pytest.raises(ValueError, match="reward function nan_at_2 gave response 2 of 4 a NaN reward"):
        trainer.generate_experiences(make_batch(trainer))


# ---------- math-verify ----------
def tags(answer):
    return f"<think>\n...\n</think>\n<answer>\n{answer}\n</answer>\n"


MATH_VERDICTS = [  # (reference answer, response, strict verdict, lenient verdict), by hand
    ("\\frac{3}{4}", tags("0.75"), True, True),  # a fraction as a decimal
    ("\\frac{3}{4}", tags("3/4"), True, True),
    ("\\frac{3}{4}", tags("\\dfrac{6}{8}"), True, True),
    ("\\frac{3}{4}", tags("4"), False, False),  # the number checker's reading of \frac{3}{4}
    ("2\\sqrt{3}", tags("\\sqrt{12}"), True, True),  # roots
    ("2\\sqrt{3}", tags("2"), False, False),
    ("(1, 2]", tags("(1,2]"), True, True),  # intervals: the brackets count
    ("(1, 2]", tags("[1, 2]"), False, False),
    ("[0,\\infty)", tags("[0, \\infty)"), True, True),
    ("5\\text{ cm}", tags("5"), True, True),  # units
    ("5", tags("5 \\text{ cm}"), True, True),
    ("7", tags("\\boxed{7}"), True, True),  # boxed
    ("\\boxed{7}", tags("7"), True, True),
    ("7", "so the answer is \\boxed{7}.", False, True),  # no tags: lenient finds the box
    ("7", tags("\\boxed{8}"), False, False),
    ("\\frac{\\pi}{2}", tags("\\pi/2"), True, True),
    ("\\{1,2\\}", tags("\\{2,1\\}"), True, True),  # sets
    ("10\\%", tags("0.1"), True, True),
    ("x^2+1", tags("1+x^2"), True, True),
    ("72", tags("seventy-two"), False, False),  # wrong
    ("72", "<answer>\n\n</answer>\nso 70 + 2 = 72", False, True),  # empty tags: lenient reads the last expression
]


def test_math_style_answers_scored_by_math_verify(tmp_path):
    from dapo_utils.cli import parse_cli
    from dapo_utils.rewards import answer_checker

    rows = [{"problem": f"problem {i}", "answer": reference} for i, (reference, *_) in enumerate(MATH_VERDICTS)]
    write_jsonl(tmp_path / "math" / "test.jsonl", rows)
    write_jsonl(tmp_path / "math" / "train.jsonl", rows)
    flags = [f"--data_path={tmp_path / 'math'}", "--question_column=problem", "--answer_column=answer"]
    _, given = parse_cli(train.DapoArguments, [*flags, "--answer_format=latex", "--answer_checker=math_verify"])
    args = build_args("seed", given)
    data = GSM8KDataset(args.data_path, None, "test", 0, (args.question_column, args.answer_column), args.answer_format)
    answers, responses = [item["answer"] for item in data], [response for _, response, *_ in MATH_VERDICTS]
    correctness = reward_functions(args, reward_func)[0]
    assert correctness.__name__ == "correctness_reward"
    assert correctness([], responses, answers) == [2.0 if strict else 0.0 for *_, strict, _ in MATH_VERDICTS]
    checker = answer_checker(args.answer_checker)
    for (reference, response, strict, lenient), answer in zip(MATH_VERDICTS, answers):  # evaluation's two rules
        (judged,) = problem_record("q", answer, [response], [1], [False], checker)["responses"]
        assert (judged["correct_strict"], judged["correct_lenient"]) == (strict, lenient), (reference, response)


def test_answer_checks_that_hang_or_raise_are_counted_and_a_slow_call_stops(tmp_path, monkeypatch):
    from dapo_utils import math_checker
    from dapo_utils.rewards import RewardTimeoutError, reward_column

    args = build_args("seed", {"answer_checker": "math_verify"})
    correctness = reward_functions(args, reward_func)[0]
    responses, answers = [tags("3/4"), tags("0.75"), "no answer"], ["\\frac{3}{4}"] * 3

    def hang(*args, **kwargs):
        time.sleep(30)

    def fail(*args, **kwargs):
        raise RecursionError("sympy")

    monkeypatch.setattr(math_checker, "CHECK_SECONDS", 0.05)
    for slow_or_bad, counted in ((hang, "reward_timeouts"), (fail, "reward_errors")):
        monkeypatch.setattr(math_checker, "verify", slow_or_bad)
        failures = {}
        column = reward_column("correctness_reward", correctness, None, [], responses, answers, "cpu", 0, failures)
        assert column.tolist() == [0.0, 0.0, 0.0]  # not correct; "no answer" has nothing to compare
        assert failures[f"{counted}/correctness_reward"] == 2
    monkeypatch.setattr(math_checker, "CHECK_SECONDS", 5)
    monkeypatch.setattr(math_checker, "verify", hang)  # the call's own limit comes first, inside the check's
    with pytest.raises(RewardTimeoutError, match="reward function correctness_reward ran past reward_timeout=0.2 s"):
        reward_column("correctness_reward", correctness, None, [], responses, answers, "cpu", 0.2, {})


# ---------- --check_rewards ----------
def math_rows(n):
    """n MATH-style problems whose answers are fractions, roots, intervals, integers and decimals, in turn."""
    forms = [
        lambda i: f"\\frac{{{i % 7 + 1}}}{{{i % 7 + 8}}}",
        lambda i: f"{i % 5 + 2}\\sqrt{{{i % 3 + 2}}}",
        lambda i: f"({i}, {i + 3}]",
        lambda i: str(i * 11),
        lambda i: f"{i}.5",
    ]
    return [{"problem": f"problem {i}", "answer": forms[i % 5](i)} for i in range(n)]


def test_check_rewards_scores_every_reference_answer_before_any_model_loads(world, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    monkeypatch.setattr(train, "load_tokenizer", lambda *a: pytest.fail("the tokenizer was loaded"))
    rows = math_rows(400)
    write_jsonl(tmp_path / "math" / "train.jsonl", rows[:300])
    write_jsonl(tmp_path / "math" / "test.jsonl", rows[300:])
    flags = [f"--data_path={tmp_path / 'math'}", "--question_column=problem", "--answer_column=answer"]
    flags += ["--answer_format=latex", "--answer_checker=math_verify", "--check_rewards"]
    with pytest.raises(SystemExit) as stopped:
        main(flags)
    printed = capsys.readouterr().out.splitlines()
    assert stopped.value.code == 1  # digit_reward reads the last number: 0.5, but 0 for the 80 decimals
    assert printed[0] == f"check_rewards: 300 train, 100 test reference answers of {str(tmp_path / 'math')!r}, " \
        "each as the perfect response"  # fmt: skip
    assert printed[2:8] == [
        "  answer checker math_verify: 400 of 400 correct",
        "  correctness_reward: 400 of 400 at its best, 2 (lowest 2)",
        "  digit_reward: 320 of 400 at its best, 0.5 (lowest 0)",
        "  hard_format_reward: 400 of 400 at its best, 0.5 (lowest 0.5)",
        "  mark_reward: 400 of 400 at its best, 0.5 (lowest 0.5)",
        "full marks: 320 of 400",
    ]
    assert printed[8] == "  train row 4: answer '4.5' ('problem 4'...): digit_reward 0 of 0.5"
    assert len(printed) == 8 + 5  # the first five that fall short
    with pytest.raises(SystemExit) as stopped:  # without digit_reward, which wants an integer
        main([*flags, "--reward_funcs=correctness_reward,hard_format_reward,mark_reward"])
    assert stopped.value.code == 0 and capsys.readouterr().out.splitlines()[-1] == "full marks: 400 of 400"
    with pytest.raises(SystemExit) as stopped:  # the seed's checker and format: these answers are refused
        main(flags[:3] + ["--check_rewards"])
    assert "cannot read in rows [0, 1, 2, 5, 6, 7, 10, 11, 12, 15]" in str(stopped.value.code)
    with pytest.raises(SystemExit) as stopped:  # the seed's data set and rewards: every answer gets full marks
        main([f"--data_path={world[1]}", "--check_rewards"])
    assert stopped.value.code == 0 and capsys.readouterr().out.splitlines()[-1] == "full marks: 40 of 40"
