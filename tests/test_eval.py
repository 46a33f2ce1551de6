"""Evaluation (evaluation.py): strict and lenient answers, pass@k and maj@k, `train.py --eval_only [--compare]`,
and what training logs at each evaluation."""

import json
import os

import datasets
import pytest
import torch

import train
from conftest import token_ids
from dapo_utils.answers import extract_answer, extract_answer_lenient, is_correct, is_correct_lenient
from dapo_utils.curves import read_jsonl
from dapo_utils.evaluation import (
    comparison_table,
    evaluate_model,
    majority_answer,
    pass_at_k,
    problem_record,
    summarise,
    use_greedy,
)
from dapo_utils.tiny_world import demo_summary
from train import main

# (response, reference answer, strict verdict, lenient verdict)
VERDICTS = [
    ("<think>\n3+5=8\n</think>\n<answer>\n8\n</answer>\n", 8, True, True),  # the format, right
    ("<think>\n3+5=8\n</think>\n<answer>\n9\n</answer>\n", 8, False, False),  # the format, wrong: tags win
    ("小明一共有 3 + 5 = 8 个苹果。", 8, False, True),  # no tags: the last number
    ("答案是 8 个。验算：8 - 5 = 3", 8, False, True),  # Chinese answer phrase: the number after it
    ("所以答案：-3", -3, False, True),  # a sign
    ("最终答案为5.0", 5, False, True),  # 5.0 is 5
    ("答：他有 1,234 元。", 1234, False, True),  # 答： and thousands separators
    ("Tom has 12 + 5 = 17 apples.", 17, False, True),  # English, no phrase: the last number
    ("The answer is 1,234. Check: 1,234 + 1 = 1,235", 1234, False, True),  # the first number after the phrase
    ("the final answer: 3/4 of the cake, 2 cakes", 0.75, False, True),  # a fraction, exact
    ("\\boxed{42}, not 41", 42, False, True),  # LaTeX's box
    ("#### 72", 72, False, True),  # GSM8K's own marker
    ("<answer>\n\n</answer>\n3 + 4 = 7", 7, False, True),  # empty tags: lenient looks further
    ("<answer>5</answer><answer>6</answer>", 5, True, True),  # doubled tags: the first block, both rules
    ("<answer>5</answer><answer>6</answer>", 6, False, False),
    ("<answer>\n-3\n</answer>\n", 3, False, False),  # "-3" is not 3
    ("<answer>\n1,234\n</answer>\n", 1234, True, True),
    ("没有数字", 0, False, False),  # no number at all
    ("答案是 7。", 8, False, False),  # lenient and wrong
]


@pytest.mark.parametrize("response, answer, strict, lenient", VERDICTS)
def test_strict_and_lenient_verdicts(response, answer, strict, lenient):
    assert is_correct(response, answer) is strict
    assert is_correct_lenient(response, answer) is lenient


def test_lenient_extraction_reads_what_strict_reads_when_the_tags_hold_a_number():
    assert (
        extract_answer_lenient("<answer>\n8\n</answer>\n答案是 9") == extract_answer("<answer>\n8\n</answer>\n") == "8"
    )
    assert extract_answer_lenient("Answer: 9 (from 4 + 5)") == "9"
    assert extract_answer_lenient("no number") == extract_answer("no number") == ""


def test_pass_at_k_against_hand_computed_values():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n = k: whether any is right
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every draw of 2 holds a right one


def test_majority_answer_compares_numbers_and_breaks_ties_by_first_seen():
    assert majority_answer(["3", "5", "5.0", "3/1", "7"]) == "3"  # 3 and 5 twice each: 3 came first
    assert majority_answer(["", "", "7"]) == "7"  # no answer is no vote
    assert majority_answer(["", ""]) == ""


def test_summarise_k_responses_per_problem():
    right, wrong, plain = "<think>\nx\n</think>\n<answer>\n4\n</answer>\n", "<answer>5</answer>", "so 4"
    records = [
        problem_record("q1", torch.tensor(4), [right, wrong, plain], [10, 6, 20], [False, False, True]),
        problem_record("q2", 4, [wrong, wrong, plain], [6, 6, 20], [False, False, True]),
    ]
    metrics = summarise(records, 3)
    assert metrics == {
        "num_problems": 2,
        "accuracy_strict": 1 / 6,  # only q1's first response
        "accuracy_lenient": 3 / 6,  # and both "so 4"
        "format_rate": 1 / 6,
        "mean_response_length": 68 / 6,
        "truncated_rate": 2 / 6,
        "pass@3_strict": 0.5,  # q1 has a right one, q2 none
        "pass@3_lenient": 1.0,
        "maj@3_strict": 0.5,  # q1: "4", "5", "" -> a tie, "4" first: right; q2: "5", "5", "" -> wrong
        "maj@3_lenient": 0.5,  # q1: 4, 5, 4 -> 4 right; q2: 5, 5, 4 -> 5 wrong
    }
    assert records[0]["answer"] == "4" and records[0]["responses"][2] == {
        "response": plain,
        "strict": "",
        "correct_strict": False,
        "lenient": "4",
        "correct_lenient": True,
        "format": False,
        "length": 20,
        "truncated": True,
    }


def test_comparison_table():
    table = comparison_table({"before": {"num_problems": 8, "accuracy_strict": 0.25}, "after": {
        "num_problems": 8, "accuracy_strict": 0.625}})  # fmt: skip
    assert table.splitlines() == [
        "metric           before   after  difference",
        "num_problems          8       8          +0",
        "accuracy_strict  0.2500  0.6250     +0.3750",
    ]


# ---------- the trainer's evaluation ----------
def scripted(trainer, texts):
    """trainer.sample answering row i of every call with texts[i % len(texts)] (+ EOS when it ends in "\\n")."""
    tok = trainer.tokenizer

    def sample(input_ids, attention_mask):
        rows = [token_ids(tok, texts[i % len(texts)]) for i in range(input_ids.size(0))]
        rows = [r + [tok.eos_token_id] if texts[i % len(texts)].endswith("\n") else r for i, r in enumerate(rows)]
        width = max(map(len, rows))
        return torch.cat(
            [input_ids, torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])], dim=1
        ), None

    trainer.sample = sample


def test_evaluate_model_with_two_responses_per_problem(make_trainer):
    trainer = make_trainer(eval_num_generations=2)
    answers = [row["answer"] for row in trainer.eval_dataset]
    right = [f"<think>\n{a}\n</think>\n<answer>\n{a}\n</answer>\n" for a in answers]
    # Per problem: right and formatted (ends with EOS), and a bare calculation, the longest row, cut off (no EOS).
    texts = [t for a, r in zip(answers, right) for t in (r, f"1+2+3+4+5+6+7+8+9={a}")]
    scripted(trainer, texts[:6])  # batches of 3 problems = 6 rows: each batch answers like the first three
    metrics, records, examples = evaluate_model(trainer, 0, 3, num_examples=2)
    assert [r["question"] for r in records] == [row["prompt"] for row in trainer.eval_dataset]  # all 8, in order
    first_three = [records[i]["answer"] == str(answers[i % 3]) for i in range(8)]
    assert metrics["num_problems"] == 8
    assert metrics["accuracy_strict"] == sum(first_three) / 16  # one formatted response per problem
    assert metrics["accuracy_lenient"] == sum(first_three) / 8
    assert metrics["format_rate"] == 0.5 and metrics["truncated_rate"] == 0.5  # bare numbers have no EOS
    assert metrics["pass@2_strict"] == metrics["pass@2_lenient"] == sum(first_three) / 8
    assert len(examples) == 2 and examples[0]["response"] == right[0]


def test_eval_metrics_during_training(make_trainer):
    trainer = make_trainer(max_steps=2, eval_steps=1, eval_samples=0)
    trainer.train()
    out = trainer.args.output_dir
    evaluations = read_jsonl(os.path.join(out, "evaluations.jsonl"))
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        strict = [line.split(",") for line in f.read().split()]
    assert [e["step"] for e in evaluations] == [0, 1, 2] == [int(step) for step, _ in strict]
    assert [f"{e['eval/accuracy']:.2f}" for e in evaluations] == [accuracy for _, accuracy in strict]
    for e in evaluations:
        assert set(e) == {"step", "eval/accuracy", "eval/accuracy_lenient", "eval/format_rate"} | {
            "eval/mean_response_length", "eval/truncated_rate"}  # fmt: skip
        assert e["eval/accuracy"] <= e["eval/accuracy_lenient"] and 1 <= e["eval/mean_response_length"] <= 12
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [{k: r[k] for k in evaluations[0] if k != "step"} for r in records] == [
        {k: v for k, v in e.items() if k != "step"} for e in evaluations[1:]
    ]  # each step's record holds its evaluation


def test_demo_summary_reports_both_accuracies_at_one_precision(tmp_path, monkeypatch):
    """Strict and lenient gains from the same full-precision evaluations (accuracy_losses.txt has 2 decimals: 0.215
    is written 0.21 and 0.615 0.61, a gain of +0.40 beside the +0.41 it is); the skipped groups are a running
    total; a fresh demo's wall time includes its world, a resumed one's says where it started."""
    monkeypatch.chdir(tmp_path)  # the demo's folder under the current one: its commands name it relatively
    out = tmp_path / "demo"
    out.mkdir()
    (out / "accuracy_losses.txt").write_text("0,0.21\n20,0.61\n")
    lines = [
        {"step": 0, "eval/accuracy": 0.205, "eval/accuracy_lenient": 0.205},
        {"step": 20, "eval/accuracy": 0.615, "eval/accuracy_lenient": 0.615},
    ]
    (out / "evaluations.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = train.DapoArguments(output_dir="demo", max_generate_length=20, eval_samples=200, eval_batch_size=200)
    history = [{"step": 20, "skipped_groups": 3687}]
    summary = demo_summary(history, args, 94.6, command=".venv/bin/python train.py").splitlines()
    assert summary[1] == "demo summary after 20 steps (3,687 groups skipped by dynamic sampling over all 20 steps):"
    assert summary[2].startswith("  held-out accuracy  step 0 0.20  ->  step 20 0.61  (+0.41)  [every evaluation: ")
    assert summary[3].startswith("  lenient accuracy   step 0 0.20  ->  step 20 0.61  (+0.41)")
    assert summary[7:] == [  # its wall time, then what to run next, on its own folders, with the interpreter that ran
        "  wall time: 1 min 35 s, the world's construction and warm-up included",
        "next steps (ready to paste in this folder):",
        "  # the warm-up model (RL's start) beside the trained one, greedy, on all 200 test problems",
        "  .venv/bin/python train.py --eval_only --model_path=demo/tiny-qwen2 --compare=demo "
        "--data_path=demo/gsm8k_tiny --device=cpu --max_generate_length=20 --eval_samples=200 "
        "--eval_batch_size=200 --output_dir=demo/eval --overwrite_output_dir=true",
        "  # curves.png again, from the logs",
        "  .venv/bin/python train.py --plot=demo",
    ]
    (out / "checkpoint_20").mkdir()  # with a checkpoint: as many steps again from it
    resumed = demo_summary(history, args, 61, str(out / "checkpoint_20"), ".venv/bin/python train.py").splitlines()
    assert resumed[7:] == [
        "  wall time: 1 min 01 s, from checkpoint_20",
        *summary[8:],
        "  # 20 more steps, from checkpoint_20",
        "  .venv/bin/python train.py --demo --resume=latest --output_dir=demo --max_steps=40",
    ]
    from dapo_utils.evaluation import accuracy_summary

    assert accuracy_summary(str(out)).endswith("step 0 0.20 / 0.20  ->  step 20 0.61 / 0.61")
    (out / "evaluations.jsonl").unlink()  # the seed's logs alone: strict from accuracy_losses.txt
    assert (
        accuracy_summary(str(out)) == "held-out accuracy (strict / lenient)  step 0 0.21 / nan  ->  step 20 0.61 / nan"
    )


# ---------- python train.py --eval_only ----------
def test_eval_only_gives_the_runs_greedy_evaluation_and_compares(make_trainer, world, tmp_path, capsys):
    """A trained model evaluated by --eval_only (from its output_dir, loaded from disk) answers exactly as the
    run's own greedy evaluation of the same problems; --compare puts the untrained model beside it."""
    model_dir, data_dir = world
    trainer = make_trainer(max_steps=2, eval_steps=100, lr=3e-3)
    trainer.train()
    trainer.save_model()
    use_greedy(trainer)
    in_run, run_records, _ = evaluate_model(trainer, 0, 4)
    out = str(tmp_path / "eval")
    common = [f"--data_path={data_dir}", f"--output_dir={out}", "--eval_samples=0", "--eval_batch_size=4"]
    common += ["--max_generate_length=12"]
    main(["--eval_only", f"--model_path={trainer.args.output_dir}", *common])
    with open(os.path.join(out, "eval_results.json")) as f:
        results = json.load(f)
    assert results["models"] == {trainer.args.output_dir: in_run} and results["settings"]["decoding"] == "greedy"
    samples = read_jsonl(os.path.join(out, "eval_samples.jsonl"))
    assert samples == [{"model": trainer.args.output_dir, **record} for record in run_records]

    capsys.readouterr()
    compare = ["--eval_only", f"--model_path={model_dir}", f"--compare={trainer.args.output_dir}", *common]
    with pytest.raises(SystemExit) as exit_info:  # a second evaluation into the same folder: refused, before loading
        main(compare)
    assert exit_info.value.code == (
        f"error: '{out}/eval_results.json' holds an earlier evaluation: overwrite it with --overwrite_output_dir=true, "
        "or write this one to another --output_dir"
    )
    main([*compare, "--overwrite_output_dir=true"])
    with open(os.path.join(out, "eval_results.json")) as f:
        results = json.load(f)
    before, after = results["models"][model_dir], results["models"][trainer.args.output_dir]
    assert after == in_run and results["difference"] == {k: after[k] - before[k] for k in after}
    samples = read_jsonl(os.path.join(out, "eval_samples.jsonl"))
    assert [s["model"] for s in samples] == [model_dir] * 8 + [trainer.args.output_dir] * 8
    assert [s["responses"] for s in samples[:8]] != [s["responses"] for s in samples[8:]]  # training changed them
    printed = capsys.readouterr().out
    assert comparison_table({model_dir: before, trainer.args.output_dir: after}) in printed


def test_eval_only_bad_input_gets_one_line_before_loading(world, tmp_path, monkeypatch):
    model_dir, data_dir = world
    monkeypatch.setattr(train, "build_trainer", lambda *a, **k: pytest.fail("a model loaded"))
    no_test, empty = tmp_path / "no_test", tmp_path / "empty"
    rows = datasets.load_dataset(data_dir)
    os.makedirs(no_test / "data")
    rows["train"].to_parquet(str(no_test / "data" / "train-00000-of-00001.parquet"))
    os.makedirs(empty / "data")
    rows["train"].to_parquet(str(empty / "data" / "train-00000-of-00001.parquet"))
    rows["test"].select([]).to_parquet(str(empty / "data" / "test-00000-of-00001.parquet"))
    cases = [
        ([f"--model_path={model_dir}", f"--data_path={no_test}"], "has no split 'test'; it has ['train']"),
        ([f"--model_path={model_dir}", f"--data_path={empty}"], "an empty or damaged file"),
        ([f"--model_path={tmp_path}/missing", f"--data_path={data_dir}"], "is not a model"),
        ([f"--model_path={model_dir}", f"--compare={tmp_path}/missing", f"--data_path={data_dir}"], "--compare"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["--eval_only", f"--output_dir={tmp_path}/out", *argv])
        assert str(exit_.value).startswith("error: ") and "\n" not in str(exit_.value) and message in str(exit_.value)
    with pytest.raises(SystemExit):
        main([f"--compare={model_dir}"])  # --compare without --eval_only


def test_eval_only_under_torchrun_gives_the_one_process_result(world, tmp_path):
    """Greedy --eval_only in 2 gloo processes (each answers every other problem, in other batches) writes what one
    process writes: 7 random problems of 8 (rank 0 draws them), batches of 3."""
    from test_distributed import run

    model_dir, data_dir = world
    argv = ["train.py", "--eval_only", f"--model_path={model_dir}", f"--data_path={data_dir}", "--device=cpu"]
    argv += ["--max_generate_length=12", "--eval_samples=7", "--eval_batch_size=3"]
    run([*argv, f"--output_dir={tmp_path}/one"])
    run([*argv, f"--output_dir={tmp_path}/two"], nproc=2)
    one, two = (read_jsonl(os.path.join(tmp_path, name, "eval_samples.jsonl")) for name in ("one", "two"))
    assert len(one) == 7 and one == two
    results = [json.load(open(os.path.join(tmp_path, name, "eval_results.json"))) for name in ("one", "two")]
    assert results[0] == results[1] and results[0]["models"][model_dir]["num_problems"] == 7
