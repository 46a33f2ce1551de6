"""No silent wrong runs: resume, bad rewards and bad settings. One test per failure a user met."""

import json
import os
import signal

import pytest
import torch

import train
from conftest import make_batch
from curves import read_jsonl
from train import DapoArguments, GSM8KDataset, main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def run_args(world, out, *extra):
    model_dir, data_dir = world
    return [f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={out}", "--device=cpu",
            "--max_generate_length=8", "--eval_samples=4", "--eval_batch_size=4", "--lr=1e-3", *extra]  # fmt: skip


def steps_in(out):
    return [record["step"] for record in read_jsonl(os.path.join(out, "metrics.jsonl"))]


# ---------- resume ----------
def test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=2", "--eval_steps=100"))
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run \\(checkpoint_2\\).*--resume=latest"):
        main(run_args(world, out, "--max_steps=2"))
    assert steps_in(out) == [1, 2]  # the earlier run's logs untouched


def test_resume_at_max_steps_trains_no_further(world, tmp_path, capsys):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=2", "--eval_steps=100"))
    trainer = main(["--resume=latest", f"--output_dir={out}"])
    assert trainer.update_steps == 2 and steps_in(out) == [1, 2]
    assert "already at step 2 of 2: nothing to train" in capsys.readouterr().out
    more = main(["--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert more.update_steps == 3 and steps_in(out) == [1, 2, 3]


def test_resume_applies_new_optimizer_settings_and_refuses_new_step_settings(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=1", "--eval_steps=100", "--warmup_steps=4"))
    with pytest.raises(SystemExit, match=r"num_generations \(4 -> 8\)"):
        main(["--resume=latest", f"--output_dir={out}", "--num_generations=8"])
    trainer = main(["--resume=latest", f"--output_dir={out}", "--lr=1e-4", "--weight_decay=0.1", "--max_steps=3"])
    group = trainer.optimizer.param_groups[0]
    # step 3 ran at warm-up factor 3/4 of the new lr; the scheduler then moved to 4/4
    assert trainer.history[-1]["learning_rate"] == pytest.approx(1e-4 * 3 / 4)
    assert group["lr"] == pytest.approx(1e-4) and group["weight_decay"] == 0.1
    with open(out / "checkpoint_3" / "dapo_args.json") as f:
        assert json.load(f)["lr"] == 1e-4  # what was recorded is what was run


def test_resume_from_another_directory_and_a_gpu_checkpoint_on_cpu(world, tmp_path, monkeypatch):
    model_dir, data_dir = world
    monkeypatch.chdir(os.path.dirname(model_dir))
    out = tmp_path / "out"
    main(run_args((os.path.basename(model_dir), data_dir), out, "--max_steps=1", "--save_steps=1", "--eval_steps=100"))
    with open(out / "checkpoint_1" / "dapo_args.json") as f:
        saved = json.load(f)
    assert saved["model_path"] == model_dir  # stored absolute
    saved["device"] = "cuda"  # as written on a GPU machine
    with open(out / "checkpoint_1" / "dapo_args.json", "w") as f:
        json.dump(saved, f)
    monkeypatch.chdir(tmp_path)
    trainer = main(["--resume=out/checkpoint_1", "--max_steps=2"])
    assert trainer.args.device == "cpu" and trainer.update_steps == 2


def test_a_half_written_metrics_line_does_not_block_resume(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1", "--save_steps=1", "--eval_steps=100"))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss"')  # the run died in the middle of a log line
    trainer = main(["--resume=latest", f"--output_dir={out}", "--max_steps=2"])
    assert trainer.update_steps == 2 and steps_in(out) == [1, 2]


def test_a_refused_resume_cuts_no_log(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=1", "--eval_steps=1"))
    before = {
        name: (out / name).read_text() for name in ("training_losses.txt", "accuracy_losses.txt", "metrics.jsonl")
    }
    with pytest.raises(SystemExit, match="batch_size"):
        main([f"--resume={out}/checkpoint_2", "--batch_size=2"])
    assert before == {name: (out / name).read_text() for name in before}


def test_ctrl_c_during_an_evaluation_keeps_its_accuracy_and_samples(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=4, eval_steps=2, save_steps=100)
    evaluate = trainer.evaluate

    def evaluate_with_ctrl_c(*args, **kwargs):
        if trainer.update_steps == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(*args, **kwargs)

    trainer.evaluate = evaluate_with_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    out = trainer.args.output_dir
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        assert [line.split(",")[0] for line in f.read().split()] == ["0", "2"]
    assert [s["step"] for s in read_jsonl(os.path.join(out, "samples.jsonl"))] == [0] * 4 + [2] * 4
    assert os.path.exists(os.path.join(out, "checkpoint_2", "trainer_state.pt"))


# ---------- rewards ----------
@pytest.mark.parametrize("count", [1, 8, 3], ids=["one-per-prompt", "twice", "other"])
def test_a_reward_function_with_the_wrong_number_of_values_is_named(make_trainer, count):
    def short_reward(prompts, responses, answers):
        return [1.0] * count

    trainer = make_trainer(reward_funcs=[short_reward])
    with pytest.raises(ValueError, match=f"reward function short_reward returned {count} values for 4 responses"):
        trainer.generate_experiences(make_batch(trainer))


def test_an_infinite_reward_is_an_error(make_trainer):
    def infinite(prompts, responses, answers):
        return [float("inf"), 0.0, 0.0, 0.0]

    trainer = make_trainer(reward_funcs=[infinite])
    with pytest.raises(ValueError, match="infinite reward; return None"):
        trainer.generate_experiences(make_batch(trainer))


def test_rewards_that_never_vary_warn_and_end_with_an_error(world, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "SEED_REWARD_FUNCS", [lambda prompts, responses, answers: [1.0] * len(responses)])
    with pytest.warns(UserWarning, match="the last 20 sampling rounds kept no group: filter_metric='reward'"):
        with pytest.raises(SystemExit, match="the data ran out before one optimizer step"):
            main(run_args(world, tmp_path / "out", "--epoch=1", "--reward_weights=1"))


# ---------- settings and set-up ----------
def test_bad_settings_stop_before_anything_loads(world, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train, "load_causal_lm", no_loading)
    monkeypatch.setattr(train, "load_tokenizer", no_loading)
    with pytest.raises(SystemExit, match="reward_weights has 2 entries for 4 reward functions"):
        main(run_args(world, tmp_path / "a", "--reward_weights=1,2"))
    with pytest.raises(SystemExit, match="lr must be finite, not inf"):
        main(run_args(world, tmp_path / "b", "--lr=inf"))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="device is cuda but no GPU is visible"):
            main(run_args(world, tmp_path / "c", "--device=cuda"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match="cannot write to output_dir"):
        main(run_args(world, tmp_path / "a_file" / "out"))
    empty_model = tmp_path / "empty_model"
    empty_model.mkdir()
    with pytest.raises(SystemExit, match="(?s)has no config.json.*hf download Qwen/Qwen2.5-1.5B-Instruct"):
        main(run_args((str(empty_model), world[1]), tmp_path / "d"))


def test_a_full_disk_at_a_checkpoint_names_the_intact_one(make_trainer, monkeypatch):
    trainer = make_trainer(max_steps=2, save_steps=1, eval_steps=100)
    save = torch.save

    def disk_full_at_step_2(obj, path, *args, **kwargs):
        if trainer.update_steps == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 64")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_2)
    with pytest.raises(RuntimeError, match="could not write checkpoint_2 \\(disk full\\?\\).*checkpoint_1 is intact"):
        trainer.train()
    out = trainer.args.output_dir
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint_1"]  # no .tmp left
    assert os.path.exists(os.path.join(out, "checkpoint_1", "trainer_state.pt"))


def test_data_set_errors_name_the_problem_and_the_fix(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(folder, split, questions, answers):
        (folder / "data").mkdir(parents=True, exist_ok=True)
        table = pa.table(
            {"question_zh-cn": pa.array(questions, pa.string()), "answer_only": pa.array(answers, pa.int64())}
        )
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")

    write(tmp_path / "empty", "train", [], [])
    with pytest.raises(ValueError, match="cannot read the data set in .*empty or damaged"):
        GSM8KDataset(str(tmp_path / "empty"), None)
    write(tmp_path / "nulls", "train", ["q1", "q2", "q3"], [1, None, 3])
    write(tmp_path / "nulls", "test", ["q4"], [4])
    with pytest.raises(ValueError, match=r"has no answer_only in rows \[1\]: fill or drop them"):
        GSM8KDataset(str(tmp_path / "nulls"), None, split="train")


def test_the_bar_says_when_the_data_ran_out_early_and_shows_a_fresh_accuracy(make_trainer, capsys):
    valid_prompts = set()

    def half_valid(prompts, responses, answers):  # half of the training prompts have unequal rewards
        return [float(i % 4 > 1) if p in valid_prompts else 1.0 for i, p in enumerate(prompts)]

    trainer = make_trainer(reward_funcs=[half_valid], epoch=1, eval_steps=2)
    valid_prompts.update(trainer.train_dataset[i]["prompt"] for i in range(0, len(trainer.train_dataset), 2))
    trainer.train()
    assert trainer.update_steps == 8 and trainer.global_steps == 16
    assert "the data ran out after 8 steps: 16 was an upper bound" in capsys.readouterr().out
    with open(os.path.join(trainer.args.output_dir, "accuracy_losses.txt")) as f:
        last_accuracy = float(f.read().split()[-1].split(",")[1])
    assert f"acc={last_accuracy:.2f}" in trainer.progress.postfix  # the evaluation of this very step


def test_arguments_validate_non_finite_floats():
    with pytest.raises(ValueError, match="temperature must be finite, not nan"):
        DapoArguments(temperature=float("nan"))


def test_the_demo_resumes_and_a_fresh_demo_leaves_no_other_runs_checkpoint(tmp_path):
    out = tmp_path / "demo"
    stale = out / "checkpoint_300"  # an earlier demo's, which --resume=latest would otherwise pick
    stale.mkdir(parents=True)
    (stale / "trainer_state.pt").write_bytes(b"")
    demo = ["--demo", f"--output_dir={out}", "--max_generate_length=8", "--eval_samples=4", "--eval_steps=100"]
    main([*demo, "--max_steps=2", "--save_steps=1"])
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    trainer = main(["--demo", "--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert trainer.update_steps == 3 and steps_in(out) == [1, 2, 3]  # continued, not restarted
    assert trainer.last_accuracy == float((out / "accuracy_losses.txt").read_text().split()[-1].split(",")[1])
