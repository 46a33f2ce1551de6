"""Seeing a run (metrics.jsonl, progress bar, curves.png, samples.jsonl) and resuming it exactly."""

import json
import os

import pytest
import torch

from train import DapoArguments, main, plot_curves, read_jsonl

REQUIRED_METRICS = {
    "step", "loss", "learning_rate", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "frac_groups_skipped",
    "skipped_groups", "num_gen_batches", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "time/sampling", "time/reward", "time/old_ref_log_probs", "time/training", "num_tokens",
    "sampled_tokens_per_second", "train_tokens_per_second",
}
REWARD_NAMES = ("correctness_reward", "digit_reward", "hard_format_reward", "mark_reward")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_metrics_progress_samples_and_curves(make_trainer):
    trainer = make_trainer(max_steps=4, eval_steps=2, beta=0.05)
    trainer.train()
    out = trainer.args.output_dir
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records == trainer.history
    for r in records:
        assert REQUIRED_METRICS | {"kl"} <= set(r), REQUIRED_METRICS - set(r)
        for name in REWARD_NAMES:
            assert {f"rewards/{name}/mean", f"rewards/{name}/std"} <= set(r)
        # all weights are 1: the mean total reward is the sum of the functions' means
        assert r["reward"] == pytest.approx(sum(r[f"rewards/{name}/mean"] for name in REWARD_NAMES))
        assert r["learning_rate"] == 1e-3 and 0 <= r["completions/clipped_ratio"] <= 1
        assert r["completions/min_length"] <= r["completions/mean_length"] <= r["completions/max_length"] <= 12
        assert r["kl"] >= 0 and r["entropy"] > 0
    assert records[-1]["skipped_groups"] == trainer.skipped_groups
    assert all(k in trainer.progress.postfix for k in ("loss=", "reward=", "skipped=", "acc="))

    samples = read_jsonl(os.path.join(out, "samples.jsonl"))
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4 + [4] * 4  # 4 examples per evaluation
    for s in samples:
        assert set(s) == {"step", "prompt", "response", "extracted_answer", "answer", "rewards"}
        assert set(s["rewards"]) == set(REWARD_NAMES) and s["answer"].isdigit()
    assert is_png(os.path.join(out, "curves.png"))


def test_plot_from_seed_files_alone(tmp_path):
    (tmp_path / "training_losses.txt").write_text("0,0.10000000\n0,0.20000000\n1,0.05000000\n1,0.05000000\n")
    (tmp_path / "accuracy_losses.txt").write_text("0,0.00\n2,0.25\n")
    main(["--plot", str(tmp_path)])
    assert is_png(tmp_path / "curves.png")
    small = os.path.getsize(tmp_path / "curves.png")
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": 0.1 * s, "rewards/mark_reward/mean": 0.1, "completions/mean_length": 5,
                            "completions/max_length": 8, "frac_groups_skipped": 0.5}) + "\n" for s in (1, 2))
    )
    plot_curves(str(tmp_path))
    assert os.path.getsize(tmp_path / "curves.png") > small  # three more panels


def comparable(records):
    """metrics.jsonl records without wall-clock figures."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("per_second")} for r in records]


def outputs(out):
    return {name: read(os.path.join(out, name)) for name in ("training_losses.txt", "accuracy_losses.txt", "samples.jsonl")}


@pytest.mark.parametrize("overrides", [dict(), dict(num_iterations=2, batch_size=2)], ids=["seed", "iterations2-batch2"])
def test_crash_and_resume_equals_an_uninterrupted_run(make_trainer, tmp_path, overrides):
    settings = dict(max_steps=6, save_steps=3, eval_steps=2, **overrides)
    reference = make_trainer(output_dir=str(tmp_path / "a"), **settings)
    reference.train()

    crashing = make_trainer(output_dir=str(tmp_path / "b"), **settings)
    original = crashing.train_step

    def crash_in_step_5(model, inputs, optimizer, step):
        if crashing.update_steps == 4 and step == 1:
            raise RuntimeError("power cut")
        return original(model, inputs, optimizer, step)

    crashing.train_step = crash_in_step_5
    with pytest.raises(RuntimeError, match="power cut"):
        crashing.train()
    out = crashing.args.output_dir
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint_3"]  # no .tmp left
    assert read(os.path.join(out, "training_losses.txt")).count("\n4,") == 1  # a line the resume must drop

    resumed = main([f"--resume={out}/checkpoint_3"])  # arguments come from the checkpoint
    assert resumed.update_steps == 6 and resumed.args.output_dir == out
    assert outputs(out) == outputs(reference.args.output_dir)  # one line per step, the same values
    assert comparable(read_jsonl(os.path.join(out, "metrics.jsonl"))) == comparable(reference.history)
    for name, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_ctrl_c_saves_a_checkpoint_that_resumes(make_trainer, tmp_path):
    settings = dict(max_steps=5, save_steps=100, eval_steps=100)
    reference = make_trainer(output_dir=str(tmp_path / "a"), **settings)
    reference.train()

    interrupted = make_trainer(output_dir=str(tmp_path / "b"), **settings)
    original = interrupted.generate_experiences

    def ctrl_c_after_step_2(batch):
        if interrupted.update_steps == 2:
            raise KeyboardInterrupt
        return original(batch)

    interrupted.generate_experiences = ctrl_c_after_step_2
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    checkpoint = os.path.join(interrupted.args.output_dir, "checkpoint_2")
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "dapo_args.json"} <= set(os.listdir(checkpoint))
    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)  # no arbitrary unpickling
    assert state["update_steps"] == 2 and state["optimizer"]["state"]
    with open(os.path.join(checkpoint, "dapo_args.json")) as f:
        assert DapoArguments(**json.load(f)).max_steps == 5

    resumed = main(["--resume=latest", f"--output_dir={interrupted.args.output_dir}"])
    assert outputs(resumed.args.output_dir) == outputs(reference.args.output_dir)
    assert comparable(resumed.history) == comparable(reference.history)


def test_resume_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        main(["--resume=latest", f"--output_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder"):
        main([f"--resume={tmp_path}"])
