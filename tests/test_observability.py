"""Seeing a run (metrics.jsonl, progress bar, curves.png, samples.jsonl) and resuming it exactly."""

import dataclasses
import importlib.util
import json
import os
import signal
import time

import pytest
import torch

from dapo_utils import curves
from dapo_utils.curves import plot_curves, read_jsonl
from train import DapoArguments, main

# The Ctrl-C test wraps optimizer.step; the LR scheduler warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

REQUIRED_METRICS = {
    "step",
    "loss",
    "learning_rate",
    "grad_norm",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "frac_groups_skipped",
    "skipped_groups",
    "num_gen_batches",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "entropy",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "time/sampling",
    "time/reward",
    "time/old_ref_log_probs",
    "time/training",
    "num_tokens",
    "sampled_tokens_per_second",
    "train_tokens_per_second",
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
    assert records[-1]["skipped_groups"] == trainer.state.skipped_groups
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
        "".join(
            json.dumps(
                {
                    "step": s,
                    "reward": 0.1 * s,
                    "rewards/mark_reward/mean": 0.1,
                    "completions/mean_length": 5,
                    "completions/max_length": 8,
                    "frac_groups_skipped": 0.5,
                }
            )
            + "\n"
            for s in (1, 2)
        )
    )
    plot_curves(str(tmp_path))
    assert os.path.getsize(tmp_path / "curves.png") > small  # three more panels


def comparable(records):
    """metrics.jsonl records without wall-clock figures."""
    wall_clock = ("time/", "perf/throughput", "perf/mfu", "perf/sampling_")  # the bound: from a measured bandwidth
    return [
        {k: v for k, v in r.items() if not k.startswith(wall_clock) and not k.endswith("per_second")} for r in records
    ]


def outputs(out):
    return {
        name: read(os.path.join(out, name)) for name in ("training_losses.txt", "accuracy_losses.txt", "samples.jsonl")
    }


def load_trainer_state(checkpoint):
    return torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=True)  # no arbitrary unpickling


@pytest.mark.parametrize(
    "overrides", [dict(), dict(num_iterations=2, batch_size=2)], ids=["seed", "iterations2-batch2"]
)
def test_crash_and_resume_equals_an_uninterrupted_run(make_trainer, tmp_path, overrides):
    settings = dict(max_steps=6, save_steps=3, eval_steps=2, **overrides)
    reference = make_trainer(output_dir=str(tmp_path / "a"), **settings)
    reference.train()

    crashing = make_trainer(output_dir=str(tmp_path / "b"), **settings)
    original = crashing.train_step
    step_5_calls = []

    def crash_in_step_5(model, inputs, normaliser=None):
        if crashing.update_steps == 4:
            step_5_calls.append(1)
            if len(step_5_calls) == 2:  # step 5's second micro-step
                raise RuntimeError("power cut")
        return original(model, inputs, normaliser)

    crashing.train_step = crash_in_step_5
    with pytest.raises(RuntimeError, match="power cut"):
        crashing.train()
    out = crashing.args.output_dir
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint_3"]  # no .tmp left
    # training_losses.txt is written at step ends: nothing of the unfinished step 5. Step 4's lines, written after
    # checkpoint_3, are the ones the resume must drop.
    assert [int(line.split(",")[0]) for line in read(os.path.join(out, "training_losses.txt")).split()] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert read(os.path.join(out, "accuracy_losses.txt")).count("\n4,") == 1
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    loop = load_trainer_state(os.path.join(out, "checkpoint_3"))["loop"]
    assert loop["update_steps"] == 3
    if crashing.args.num_iterations == 2:
        # Steps 3 and 4 are the two passes over the second rollout: checkpoint_3 lies between them, so it holds
        # that rollout (with the old log-probs of its first pass) and one pass done.
        assert loop["updates_done"] == 1 and len(loop["rollout"]) == 2  # GA=2 micro-batches
        assert all(m["old_action_log_probs"].shape == m["action_mask"].shape for m in loop["rollout"])
    else:
        assert loop["rollout"] is None

    resumed = main([f"--resume={out}/checkpoint_3"])  # arguments come from the checkpoint
    assert resumed.update_steps == 6 and resumed.args.output_dir == out
    assert outputs(out) == outputs(reference.args.output_dir)  # one line per step, the same values
    assert comparable(read_jsonl(os.path.join(out, "metrics.jsonl"))) == comparable(reference.history)
    for name, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def send_ctrl_c_during_step(trainer, step, times=1):
    """Send SIGINT to this process `times` times from inside optimizer.step of optimizer step `step` (1-based)."""
    original = trainer.optimizer.step

    def step_with_ctrl_c(*args, **kwargs):
        if trainer.update_steps == step - 1:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    trainer.optimizer.step = step_with_ctrl_c


def test_ctrl_c_saves_a_checkpoint_that_resumes(make_trainer, tmp_path):
    settings = dict(max_steps=5, save_steps=100, eval_steps=100)
    reference = make_trainer(output_dir=str(tmp_path / "a"), **settings)
    reference.train()

    interrupted = make_trainer(output_dir=str(tmp_path / "b"), **settings)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest runs as a background job
    send_ctrl_c_during_step(interrupted, 3)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert interrupted.stop_requested and interrupted.update_steps == 3  # step 3 was finished, not cut short
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    out = interrupted.args.output_dir
    checkpoint = os.path.join(out, "checkpoint_3")
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint_3"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "dapo_args.json"} <= set(
        os.listdir(checkpoint)
    )
    state = load_trainer_state(checkpoint)
    assert state["loop"]["update_steps"] == 3 and state["optimizer"]["state"]
    with open(os.path.join(checkpoint, "dapo_args.json")) as f:
        assert DapoArguments(**json.load(f)).max_steps == 5

    resumed = main(["--resume=latest", f"--output_dir={out}"])
    assert resumed.update_steps == 5
    assert outputs(resumed.args.output_dir) == outputs(reference.args.output_dir)
    assert comparable(resumed.history) == comparable(reference.history)
    for name, value in reference.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_second_ctrl_c_or_a_raised_interrupt_stops_at_once_without_a_checkpoint(make_trainer, tmp_path):
    trainer = make_trainer(output_dir=str(tmp_path / "twice"), max_steps=5, save_steps=100, eval_steps=100)
    send_ctrl_c_during_step(trainer, 3, times=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.update_steps == 2  # step 3 never finished
    assert not [d for d in os.listdir(trainer.args.output_dir) if d.startswith("checkpoint")]

    # A KeyboardInterrupt raised by code (not a signal) propagates without saving either.
    trainer = make_trainer(output_dir=str(tmp_path / "raised"), max_steps=5, save_steps=100, eval_steps=100)
    original = trainer.generate_experiences

    def interrupt_after_step_2(batch):
        if trainer.update_steps == 2:
            raise KeyboardInterrupt
        return original(batch)

    trainer.generate_experiences = interrupt_after_step_2
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.update_steps == 2 and not trainer.stop_requested
    assert not [d for d in os.listdir(trainer.args.output_dir) if d.startswith("checkpoint")]


def test_resume_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint to resume"):
        main(["--resume=latest", f"--output_dir={tmp_path}"])
    with pytest.raises(SystemExit, match="is not a checkpoint folder"):
        main([f"--resume={tmp_path}"])


# ---------- report_to, --help, plotting ----------
def test_report_to_tensorboard_writes_the_metrics(make_trainer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(report_to="tensorboard", max_steps=2, eval_steps=1)
    trainer.train()
    events = EventAccumulator(os.path.join(trainer.args.output_dir, "runs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "reward", "grad_norm", "learning_rate", "num_gen_batches", "eval/accuracy"} <= tags
    assert "step" not in tags
    for key in ("loss", "reward", "grad_norm", "entropy"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in trainer.history], rel=1e-6), key
    accuracy = read(os.path.join(trainer.args.output_dir, "accuracy_losses.txt")).split()
    assert [(s.step, round(s.value, 2)) for s in events.Scalars("eval/accuracy")] == [
        (int(line.split(",")[0]), float(line.split(",")[1])) for line in accuracy
    ]  # steps 0, 1, 2


def test_report_to_wandb_without_wandb_names_the_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        DapoArguments(report_to="wandb")
    with pytest.raises(ValueError, match="report_to must be one of"):
        DapoArguments(report_to="mlflow")
    assert DapoArguments(report_to="none").report_to == "none"


def test_help_lists_every_field_with_its_help_text(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping inside a help text
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(DapoArguments):
        assert f"--{f.name}" in text, f.name
        help_text = " ".join(f.metadata["help"].replace("%%", "%").split())  # argparse prints %% as %
        assert help_text and help_text in text, (f.name, help_text)
    for option in ("--demo", "--preset", "--resume", "--plot"):
        assert option in text
    # Literal fields: --help lists their values, argparse refuses others, and so does DapoArguments in code
    assert "--loss_agg_mode {seed,token-mean,seq-mean-token-mean,seq-mean-token-sum-norm}" in text
    assert "--filter_metric {reward,correctness,none}" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["--loss_agg_mode=mean"])
    assert exit_info.value.code == 2 and "invalid choice: 'mean'" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"loss_agg_mode must be one of \('seed', 'token-mean', 'seq-mean-token-mean', 'seq-mean-"
    ):
        DapoArguments(loss_agg_mode="mean")


def test_a_plotting_failure_is_a_warning_not_a_crash(make_trainer, monkeypatch):
    def broken(output_dir):
        raise RuntimeError("no display")

    monkeypatch.setattr(curves, "plot_curves", broken)
    trainer = make_trainer(max_steps=2, eval_steps=1)
    with pytest.warns(UserWarning, match="could not draw curves.png.*no display"):
        trainer.train()
    assert trainer.update_steps == 2 and len(trainer.history) == 2
    assert not os.path.exists(os.path.join(trainer.args.output_dir, "curves.png"))


def test_every_record_of_a_run_has_the_same_keys_whatever_happened_at_its_step(make_trainer):
    """A step that did not sample (steps_per_generation 2: steps 2 and 4 train on step 1's and 3's rollout) or did
    not evaluate keeps those keys as null, so no reader depends on which groups lagged or which step evaluated."""
    trainer = make_trainer(max_steps=4, eval_steps=2, steps_per_generation=2, gradient_accumulation_steps=1)
    trainer.train()
    records = read_jsonl(os.path.join(trainer.args.output_dir, "metrics.jsonl"))
    assert [set(r) for r in records] == [set(records[0])] * 4 and REQUIRED_METRICS <= set(records[0])
    assert [r["reward"] is None for r in records] == [False, True, False, True]  # sampled at steps 1 and 3
    assert [r["eval/accuracy"] is None for r in records] == [True, False, True, False]  # evaluated at 2 and 4
    assert [r["time/sampling"] is None for r in records] == [False, True, False, True]  # no sampling call: null
    assert [set(r) for r in curves.read_metrics(os.path.join(trainer.args.output_dir, "metrics.jsonl"))][1] == {
        key for key, value in records[1].items() if value is not None
    }  # the plots' reader drops the nulls


def test_time_per_step_leaves_out_every_evaluation_step_0s_included(make_trainer):
    """time/step runs from a step's first sampling round to its optimizer step: an evaluation that takes 0.6 s (step
    0's before step 1, and one after each step) is in none of them, so MFU and throughput are the training's."""
    trainer = make_trainer(max_steps=3, eval_steps=1, gradient_accumulation_steps=1)
    evaluate, evaluations = trainer.evaluate, []

    def slow_evaluation(*args, **kwargs):
        time.sleep(0.6)
        evaluations.append(1)
        return evaluate(*args, **kwargs)

    trainer.evaluate = slow_evaluation
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    records = read_jsonl(os.path.join(trainer.args.output_dir, "metrics.jsonl"))
    steps = [r["time/step"] for r in records]
    assert len(evaluations) == 4 and wall > 2.4  # steps 0 to 3
    assert len(steps) == 3 and max(steps) < 0.6 and sum(steps) < wall - 2.4, steps


def test_a_metric_without_values_keeps_its_keys_as_none():
    """No lagged token this step (vLLM), a reward function that returned None for every response, a micro-batch whose
    tokens were all filtered out: each name's record keys are there, with None."""
    from dapo_utils.trackers import loss_diagnostics, step_record

    empty = torch.zeros(2, 0)
    diagnostics = loss_diagnostics(empty, torch.zeros(2), empty, None, empty.long(), 0.2, 0.28)
    assert diagnostics == {"clip_ratio/low_mean": None, "clip_ratio/high_mean": None, "entropy": None}
    metrics = {"vllm/lag_logprob_diff": [[], []], "rewards/judge": [float("nan")] * 4, "loss": [0.5, 0.25]}
    record = step_record(3, {**metrics, **{key: [value] for key, value in diagnostics.items()}})
    lag = {f"vllm/lag_logprob_diff_{name}": None for name in ("mean", "p50", "p95", "max")}
    assert record == {"step": 3, **lag, "rewards/judge/mean": None, "rewards/judge/std": None, "loss": 0.75} | {
        key: None for key in diagnostics
    }
