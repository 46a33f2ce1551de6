"""Tests for tiny_world: everything is checked after reloading from disk, as train.py would."""

import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

# The repo root, where dapo_utils/tiny_world.py and train.py live.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapo_utils import (
    curves,  # noqa: E402
    tiny_world,  # noqa: E402
)
from train import SYSTEM_PROMPT  # noqa: E402

QUESTION = "小明有3个苹果，又买了5个，现在一共有几个苹果？"
COLUMNS = ["question", "answer", "question_zh-cn", "answer_only"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("world"))
    return tiny_world.build_tiny_world(root, SYSTEM_PROMPT, num_train=40, num_test=10)  # (model_dir, data_dir)


@pytest.fixture(scope="module")
def tokenizer(world):
    return AutoTokenizer.from_pretrained(world[0])


def solve(question_zh: str) -> int:
    """The answer to a generated Chinese problem, from its two numbers and its verb."""
    a, b = map(int, re.findall(r"\d+", question_zh))
    return a - b if "送给" in question_zh or "弄丢" in question_zh else a + b


def test_make_problems_is_deterministic_and_well_formed():
    rows = tiny_world.make_problems(100, seed=3)
    assert rows == tiny_world.make_problems(100, seed=3)
    assert rows != tiny_world.make_problems(100, seed=4)
    for row in rows:
        assert list(row) == COLUMNS
        assert row["answer_only"] == solve(row["question_zh-cn"])
        assert 0 <= row["answer_only"] <= 10
        assert row["answer"].endswith(f"\n#### {row['answer_only']}")


def test_dataset_loads_like_the_hub_one(world, tmp_path):
    ds = datasets.load_dataset(world[1], cache_dir=str(tmp_path))
    assert set(ds) == {"train", "test"}
    assert ds["train"].num_rows == 40 and ds["test"].num_rows == 10
    for split in ds.values():
        assert split.column_names == COLUMNS
        assert split.features["answer_only"].dtype == "int64"
    for row in list(ds["train"])[:5] + list(ds["test"])[:5]:
        assert row["answer_only"] == solve(row["question_zh-cn"])
    # Different seeds per split, so test is not a copy of the start of train.
    assert list(ds["test"]["question_zh-cn"]) != list(ds["train"]["question_zh-cn"])[:10]


def test_no_test_question_is_in_the_train_split():
    """Held out means held out: the demo's test phrasings (template, name, item) never occur in
    train, so no test question string does, while every test fact (op, a, b) is trained on."""
    train_phrasings, test_phrasings = tiny_world.split_phrasings()
    assert train_phrasings and test_phrasings and not set(train_phrasings) & set(test_phrasings)
    splits = tiny_world.make_splits(tiny_world.DEMO_NUM_TRAIN, tiny_world.DEMO_NUM_TEST, seed=0)
    train = {row["question_zh-cn"] for row in splits["train"]} | {row["question"] for row in splits["train"]}
    test = splits["test"]
    assert len(test) == tiny_world.DEMO_NUM_TEST == len({row["question_zh-cn"] for row in test})  # all distinct
    assert not [row for row in test if row["question_zh-cn"] in train or row["question"] in train]
    assert {row["answer"] for row in test} <= {row["answer"] for row in splits["train"]}  # same facts


def test_held_out_split_on_disk(world, tmp_path):
    ds = datasets.load_dataset(world[1], cache_dir=str(tmp_path))
    assert not set(ds["test"]["question_zh-cn"]) & set(ds["train"]["question_zh-cn"])


def test_noisy_warm_up_responses_are_off_by_one_to_three():
    import random

    row = tiny_world.make_row(("+", 2, 3), (0, 0, 0))
    assert tiny_world.noisy_response(row, 0.0, random.Random(0)) == tiny_world.ideal_response(row)
    rng = random.Random(0)
    wrong = [tiny_world.noisy_response(row, 1.0, rng) for _ in range(200)]
    answers = {int(re.search(r"<answer>\n(\d+)", w).group(1)) for w in wrong}
    assert answers == {2, 3, 4, 6, 7, 8}
    assert all(re.search(r"2\+3=(\d+)\n</think>\n<answer>\n\1\n", w) for w in wrong)  # consistent


def test_write_dataset_honours_seed(tmp_path):
    data_dir = tiny_world.write_dataset(str(tmp_path / "d"), num_train=5, num_test=3, seed=7)
    ds = datasets.load_dataset(data_dir, cache_dir=str(tmp_path / "cache"))
    assert ds["train"].to_list() == tiny_world.make_splits(5, 3, seed=7)["train"]
    assert ds["test"].num_rows == 3


def test_tokenizer_special_tokens_and_size(tokenizer):
    assert 90 <= len(tokenizer) <= 310
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    for token in SPECIALS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
        assert token in tokenizer.all_special_tokens


@pytest.mark.parametrize("tag", ["<think>\n", "</think>\n", "<answer>\n", "</answer>\n"])
def test_format_tags_are_single_ordinary_tokens(tokenizer, tag):
    ids = tokenizer.encode(tag, add_special_tokens=False)
    assert len(ids) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == tag
    ids = tokenizer.encode(f"<|im_start|>assistant\n{tag}8<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"assistant\n{tag}8"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == tiny_world.chatml_prompt(SYSTEM_PROMPT, QUESTION)
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt + "<|im_start|>assistant\n" == text


def test_chinese_round_trip_after_reload(tokenizer):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += "<think>\n3+5=8\n</think>\n<answer>\n8\n</answer>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # Reward functions see the completion decoded without special tokens.
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        f"system\n{SYSTEM_PROMPT}\nuser\n{QUESTION}\nassistant\n<think>\n3+5=8\n</think>\n<answer>\n8\n</answer>\n"
    )


def test_every_problem_round_trips(world, tokenizer, tmp_path):
    ds = datasets.load_dataset(world[1], cache_dir=str(tmp_path))
    questions = list(ds["train"]["question_zh-cn"]) + list(ds["test"]["question_zh-cn"])
    encoded = tokenizer(questions, add_special_tokens=False)["input_ids"]
    for question, ids in zip(questions, encoded):
        assert tokenizer.decode(ids) == question


def test_model_config_and_forward(world, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(world[0])
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 2)
    assert config.intermediate_size == 128
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert config.bos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.dtype == torch.float32
    generation = model.generation_config
    assert generation.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert generation.pad_token_id == tokenizer.pad_token_id

    prompt = tiny_world.chatml_prompt(SYSTEM_PROMPT, QUESTION)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_model_is_seeded():
    tok = tiny_world.build_tokenizer(["<think>\n1+1=2\n</think>\n小明有2个苹果"])
    a, b, c = (tiny_world.build_tiny_model(tok, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_build_fails_loudly_if_the_reloaded_tokenizer_loses_characters(tmp_path, monkeypatch):
    """The transformers 5 pitfall: a qwen2 model folder reloads as Qwen2Tokenizer, which swaps in a
    byte-level pipeline, so a character-level vocabulary silently loses every Chinese character."""

    def char_level_tokenizer(texts, vocab_size=150):
        backend = Tokenizer(models.BPE())
        backend.decoder = decoders.Fuse()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
        backend.train_from_iterator(texts, trainer)
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=tiny_world.CHAT_TEMPLATE,
        )

    in_memory = char_level_tokenizer([QUESTION])
    assert in_memory.decode(in_memory.encode(QUESTION)) == QUESTION  # fine until saved and reloaded
    monkeypatch.setattr(tiny_world, "build_tokenizer", char_level_tokenizer)
    with pytest.raises(RuntimeError, match="does not round-trip"):
        tiny_world.build_tiny_world(str(tmp_path), SYSTEM_PROMPT, num_train=4, num_test=2)


# ---------- curves.png ----------
def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_smooth_is_a_centred_moving_average():
    assert curves.smooth([0, 2, 4, 6, 8], window=3) == [1, 2, 4, 6, 7]  # cut short at both ends
    assert curves.smooth([0, 2, 4, 6, 8], window=1) == [0, 2, 4, 6, 8]
    assert curves.smooth([3.0] * 7) == [3.0] * 7
    ramp = list(range(60))  # default window: 2 * (60 // 20) + 1 = 7, a straight line stays put inside
    assert curves.smooth(ramp)[3:-3] == pytest.approx(ramp[3:-3])
    assert curves.smooth(ramp)[0] == pytest.approx(1.5)  # mean of 0..3
    assert curves.smooth([]) == []


def test_appended_second_run_does_not_add_to_the_first(tmp_path):
    # Run 1: two micro-steps per step for steps 1 and 2; run 2 (appended) starts again at step 1.
    (tmp_path / "training_losses.txt").write_text("0,0.1\n0,0.2\n1,0.5\n1,0.5\n0,0.25\n0,0.25\n")
    (tmp_path / "accuracy_losses.txt").write_text("0,0.10\n2,0.40\n0,0.20\n")
    assert curves.read_step_log(str(tmp_path / "training_losses.txt")) == pytest.approx({0: 0.5, 1: 1.0})
    assert curves.read_step_log(str(tmp_path / "accuracy_losses.txt")) == pytest.approx({0: 0.2, 2: 0.4})
    records = [{"step": s, "reward": r} for s, r in ((1, 1.0), (2, 2.0), (1, 5.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert curves.read_metrics(str(tmp_path / "metrics.jsonl")) == [
        {"step": 1, "reward": 5.0},
        {"step": 2, "reward": 2.0},
    ]


def test_plot_curves_draws_faint_raw_series_under_their_moving_average(tmp_path, monkeypatch):
    steps = range(1, 61)
    (tmp_path / "training_losses.txt").write_text("".join(f"{s - 1},{0.01 * (s % 7)}\n" for s in steps))
    (tmp_path / "accuracy_losses.txt").write_text("0,0.15\n30,0.40\n60,0.62\n")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "reward": 0.02 * s + 0.3 * (s % 2),
                    "rewards/correctness_reward/mean": 0.01 * s,
                    "completions/mean_length": 12,
                    "completions/max_length": 20,
                    "frac_groups_skipped": 0.25,
                }
            )
            + "\n"
            for s in steps
        )
    )
    drawn = []  # (label, steps, raw values, smoothed values) of every per-step series
    original = curves.draw_series

    def spy(ax, points, label, color):
        original(ax, points, label, color)
        raw, smoothed = ax.get_lines()[-2:]
        drawn.append((label, list(raw.get_xdata()), list(raw.get_ydata()), list(smoothed.get_ydata()), raw.get_alpha()))

    monkeypatch.setattr(curves, "draw_series", spy)
    path = curves.plot_curves(str(tmp_path))
    assert path == str(tmp_path / "curves.png") and is_png(path)
    by_label = {label: rest for label, *rest in drawn}
    assert {"total", "correctness_reward", "loss", "mean", "max", "skipped"} <= set(by_label)
    x, raw, smoothed, alpha = by_label["total"]
    assert x == list(steps) and raw == pytest.approx([0.02 * s + 0.3 * (s % 2) for s in steps])
    assert smoothed == pytest.approx(curves.smooth(raw)) and alpha < 0.5  # faint raw, solid average
    assert by_label["loss"][0] == list(steps)  # micro-step line k belongs to step k + 1


def test_curves_keep_equal_series_apart_and_say_so(tmp_path, monkeypatch):
    """Strict and lenient accuracy equal at every evaluation: lenient dashed with hollow markers over strict, its label
    saying so; three reward functions flat at about one value (closer than a line is wide): one line, labelled with
    every name and how close they are."""
    evaluations = [{"step": s, "eval/accuracy": a, "eval/accuracy_lenient": a} for s, a in ((0, 0.2), (10, 0.5))]
    (tmp_path / "evaluations.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    rewards = {f"rewards/{name}/mean": 0.5 for name in ("digit_reward", "hard_format_reward")}  # and mark_reward:
    records = [
        {"step": s, "reward": 1.5 + 0.1 * s, "rewards/correctness_reward/mean": 0.1 * s, **rewards} for s in (1, 2)
    ]
    records[0]["rewards/mark_reward/mean"], records[1]["rewards/mark_reward/mean"] = 0.5, 0.49  # 0.01 of a 1.6 span
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn, axes, draw_accuracy, draw_series = [], [], curves.draw_accuracy, curves.draw_series

    def accuracy_spy(ax, accuracy, label, color, second=False):
        draw_accuracy(ax, accuracy, label, color, second)
        line = ax.get_lines()[-1]
        drawn.append((label, line.get_linestyle(), line.get_markerfacecolor(), list(line.get_ydata())))
        axes.append(ax)

    def series_spy(ax, points, label, color):
        draw_series(ax, points, label, color)
        drawn.append((label, list(ax.get_lines()[-1].get_ydata())))

    monkeypatch.setattr(curves, "draw_accuracy", accuracy_spy)
    monkeypatch.setattr(curves, "draw_series", series_spy)
    curves.plot_curves(str(tmp_path))
    assert drawn[:2] == [
        ("strict (answer tags)", "-", curves.ACCURACY_COLOR, [0.2, 0.5]),
        ("lenient (final answer): equal to strict at every evaluation", "--", "none", [0.2, 0.5]),
    ]
    assert drawn[2:] == [
        ("total", [1.6, 1.7]),
        ("correctness_reward", [0.1, 0.2]),
        ("digit_reward = hard_format_reward = mark_reward (within 0.01)", [0.5, 0.5]),
    ]
    legend = [" ".join(t.get_text().split()) for t in axes[0].get_legend().get_texts()]  # names both (wrapped)
    assert legend == [drawn[0][0], drawn[1][0]] and axes[0].get_title(loc="left") == "held-out accuracy (test split)"
    apart = {"a": {1: 0.5, 2: 0.5}, "b": {1: 0.5, 2: 0.6}, "c": {}, "d": {}, "e": {1: 0.5}}  # 0.1 of a 0.1 span
    assert curves.coinciding(apart) == apart
    assert list(curves.coinciding({"a": {1: 0.0, 2: 1.0}, "b": {1: 0.0, 2: 1.0}})) == ["a = b (equal)"]


def test_the_warm_up_runs_on_one_thread_and_gives_the_threads_back(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(tiny_world, "warm_up", lambda *args, **kwargs: seen.append(torch.get_num_threads()))
    original = torch.get_num_threads()
    torch.set_num_threads(max(2, original))
    try:
        tiny_world.build_tiny_world(str(tmp_path), SYSTEM_PROMPT, num_train=8, num_test=4, warm_up_steps=2)
        assert seen == [1] and torch.get_num_threads() == max(2, original)
    finally:
        torch.set_num_threads(original)
