"""No silent wrong runs: resume, bad rewards and bad settings. One test per failure a user met."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings

import pytest
import torch

import train
from conftest import make_batch
from dapo_utils import checkpoints
from dapo_utils.answers import is_correct
from dapo_utils.checkpoints import write_checksums
from dapo_utils.curves import read_jsonl
from dapo_utils.rewards import RewardFunctionError
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
    saved["device"] = "cuda"  # as written on a GPU machine, with its checksums
    with open(out / "checkpoint_1" / "dapo_args.json", "w") as f:
        json.dump(saved, f)
    write_checksums(out / "checkpoint_1")
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


def test_ctrl_c_as_an_evaluation_starts_stops_it_and_the_resume_evaluates_that_step_first(make_trainer, tmp_path):
    """The evaluation of step 2 stops before its first batch: nothing of it is written, the checkpoint says it is
    due, and the resumed run writes it, then steps 3 and 4 (test_stops.py: the same against an uninterrupted run)."""
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
    evaluated = lambda: [line.split(",")[0] for line in open(os.path.join(out, "accuracy_losses.txt")).read().split()]  # noqa: E731
    assert evaluated() == ["0"] and [s["step"] for s in read_jsonl(os.path.join(out, "samples.jsonl"))] == [0] * 4
    loop = torch.load(os.path.join(out, "checkpoint_2", "trainer_state.pt"), weights_only=True)["loop"]
    assert loop["update_steps"] == 2 and loop["evaluation_pending"] and loop["metrics"]["loss"]
    main(["--resume=latest", f"--output_dir={out}"])
    assert evaluated() == ["0", "2", "4"]
    assert [s["step"] for s in read_jsonl(os.path.join(out, "samples.jsonl"))] == [0] * 4 + [2] * 4 + [4] * 4
    assert [r["step"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]


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


def constant_reward(prompts, responses, answers):
    return [1.0] * len(responses)


def test_rewards_that_never_vary_warn_and_end_with_an_error(world, tmp_path):
    rewards = "--reward_funcs=test_reliability:constant_reward"  # this file's, found on sys.path
    with pytest.warns(UserWarning, match="the last 20 sampling rounds kept no group: filter_metric='reward'"):
        with pytest.raises(SystemExit, match="the data ran out before one optimizer step"):
            main(run_args(world, tmp_path / "out", "--epoch=1", rewards))


# ---------- settings and set-up ----------
def test_bad_settings_stop_before_anything_loads(world, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(checkpoints, "load_causal_lm", no_loading)  # DapoTrainer loads model_path
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
    with pytest.raises(
        RuntimeError, match="could not write checkpoint_2 \\(disk full\\?\\): .*unexpected pos 128 vs 64$"
    ):
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


def test_the_demo_resumes_and_a_fresh_demo_clears_only_a_folder_it_made(tmp_path):
    out = tmp_path / "demo"
    stale = out / "checkpoint_300"  # an earlier demo's, which --resume=latest would otherwise pick
    stale.mkdir(parents=True)
    (stale / "trainer_state.pt").write_bytes(b"")
    (out / "demo_world.txt").write_text("")  # that demo's mark on the folder it made
    demo = ["--demo", f"--output_dir={out}", "--max_generate_length=8", "--eval_samples=4", "--eval_steps=100"]
    main([*demo, "--max_steps=2", "--save_steps=1"])  # a fresh demo in a demo's folder: cleared, then run
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    assert "--demo" in (out / "demo_world.txt").read_text()  # marked again
    trainer = main(["--demo", "--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert trainer.update_steps == 3 and steps_in(out) == [1, 2, 3]  # continued, not restarted
    assert trainer.last_accuracy == float((out / "accuracy_losses.txt").read_text().split()[-1].split(",")[1])


# ---------- output folders that belong to one run ----------
def test_the_demo_refuses_a_folder_it_did_not_make(tmp_path, monkeypatch):
    from dapo_utils import tiny_world

    def no_world(*args, **kwargs):
        raise AssertionError("the demo built its world in another run's folder")

    monkeypatch.setattr(tiny_world, "build_tiny_world", no_world)
    out = tmp_path / "real_run"
    (out / "checkpoint_15").mkdir(parents=True)
    (out / "checkpoint_15" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 15}\n')
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run \\(checkpoint_15\\).*--output_dir"):
        main(["--demo", f"--output_dir={out}"])
    assert (out / "checkpoint_15" / "model.safetensors").read_bytes() == b"weights"
    assert (out / "metrics.jsonl").read_text() == '{"step": 15}\n'
    assert not (out / "train.lock").exists()


def lock_of(pid):
    return json.dumps({"pid": pid, "host": socket.gethostname()})


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_holder(world, tmp_path, monkeypatch):
    out, started, finish, errors = tmp_path / "out", threading.Event(), threading.Event(), []
    evaluate = train.DapoTrainer.evaluate

    def first_evaluation_waits(self, *args, **kwargs):  # the first run holds the folder until told to go on
        if not started.is_set():
            started.set()
            finish.wait(120)
        return evaluate(self, *args, **kwargs)

    def first_run():
        try:
            main(run_args(world, out, "--max_steps=2", "--eval_steps=100", "--seed=1"))
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    monkeypatch.setattr(train.DapoTrainer, "evaluate", first_evaluation_waits)
    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        assert started.wait(120)
        holder = f"PID {os.getpid()} on host {socket.gethostname()}"
        with pytest.raises(SystemExit, match=f"is in use by another run \\({holder}\\)"):
            main(run_args(world, out, "--max_steps=2", "--eval_steps=100", "--seed=2"))
    finally:
        finish.set()
        thread.join()
    assert errors == [] and steps_in(out) == [1, 2]  # the first run's, not doubled
    assert not (out / "train.lock").exists()  # released at its end


def test_a_stale_lock_is_reported_and_taken_over_only_when_asked(world, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID that no longer runs: a run killed with -9
    (out / "train.lock").write_text(lock_of(gone.pid))
    with pytest.raises(SystemExit, match=f"lock of PID {gone.pid} on host .*no longer runs.*--take_over_lock"):
        main(run_args(world, out, "--max_steps=1", "--eval_steps=100"))
    main(run_args(world, out, "--max_steps=1", "--eval_steps=100", "--take_over_lock"))
    assert steps_in(out) == [1] and not (out / "train.lock").exists()

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(train.DapoTrainer, "train", ctrl_c)  # the KeyboardInterrupt path also lets go
    with pytest.raises(SystemExit) as stopped:
        main(run_args(world, out, "--max_steps=1", "--overwrite_output_dir=true"))
    assert stopped.value.code == 130 and not (out / "train.lock").exists()


def test_a_fresh_run_refuses_a_finished_runs_folder_unless_asked_to_overwrite(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--eval_steps=100"))  # logs and a final model, no checkpoint
    model = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="holds the logs and model of an earlier run.*--overwrite_output_dir=true"):
        main(run_args(world, out, "--max_steps=1", "--eval_steps=100", "--seed=2"))
    assert steps_in(out) == [1, 2] and (out / "model.safetensors").read_bytes() == model
    main(run_args(world, out, "--max_steps=1", "--eval_steps=100", "--seed=2", "--overwrite_output_dir=true"))
    assert steps_in(out) == [1] and (out / "model.safetensors").read_bytes() != model


# ---------- checkpoints that survive damage ----------
def cut_in_half(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1", "--save_steps=1", "--eval_steps=100"))
    kept = (out / "checkpoint_1" / "trainer_state.pt").read_bytes()
    main(["--resume=latest", f"--output_dir={out}", "--max_steps=2"])
    assert not (out / "checkpoint_1" / "trainer_state.pt").exists()  # only the newest keeps its trainer state
    backup = tmp_path / "checkpoint_2"
    shutil.copytree(out / "checkpoint_2", backup)
    cut_in_half(out / "checkpoint_2" / "model.safetensors")
    with pytest.raises(SystemExit, match="checkpoint_2/model.safetensors is damaged.*no intact checkpoint keeps"):
        main(["--resume=latest", f"--output_dir={out}"])
    # a run killed between writing checkpoint_2 and dropping checkpoint_1's trainer state: checkpoint_1 resumes
    (out / "checkpoint_1" / "trainer_state.pt").write_bytes(kept)
    intact = f"--resume={out}/checkpoint_1"
    with pytest.raises(SystemExit, match=f"checkpoint_2/model.safetensors is damaged.*{intact}$"):
        main(["--resume=latest", f"--output_dir={out}"])
    shutil.rmtree(out / "checkpoint_2")
    shutil.copytree(backup, out / "checkpoint_2")
    cut_in_half(out / "checkpoint_2" / "trainer_state.pt")
    with pytest.raises(SystemExit, match=f"checkpoint_2/trainer_state.pt is damaged.*{intact}$"):
        main(["--resume=latest", f"--output_dir={out}"])
    os.remove(out / "checkpoint_2" / "trainer_state.pt")
    with pytest.raises(SystemExit, match=f"checkpoint_2/trainer_state.pt is missing.*{intact}$"):
        main(["--resume=latest", f"--output_dir={out}"])
    assert main([intact, "--max_steps=2"]).update_steps == 2


def test_the_previous_trainer_state_stays_until_the_new_checkpoint_reads_back(make_trainer, monkeypatch):
    trainer = make_trainer(max_steps=2, save_steps=1, eval_steps=100)
    save_pretrained = trainer.model.save_pretrained

    def weights_lost_at_step_2(folder, *args, **kwargs):  # a write that "succeeds" but leaves half a file
        save_pretrained(folder, *args, **kwargs)
        if trainer.update_steps == 2:
            cut_in_half(pathlib.Path(folder) / "model.safetensors")

    monkeypatch.setattr(trainer.model, "save_pretrained", weights_lost_at_step_2)
    with pytest.raises(
        RuntimeError, match="could not write checkpoint_2 \\(disk full\\?\\): .*model.safetensors is damaged"
    ):
        trainer.train()
    out = trainer.args.output_dir
    assert [name for name in os.listdir(out) if name.startswith("checkpoint")] == ["checkpoint_1"]
    assert os.path.exists(os.path.join(out, "checkpoint_1", "trainer_state.pt"))


def test_resume_latest_without_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=f"error: no checkpoint to resume in '{tmp_path}'"):
        main(["--resume=latest", f"--output_dir={tmp_path}"])


# ---------- errors that name their source ----------
def parse_reward(prompts, responses, answers):
    return [float("x") for _ in responses]


def test_a_reward_functions_error_names_it_and_debug_keeps_its_traceback(world, tmp_path):
    out = tmp_path / "out"
    message = "reward function parse_reward raised ValueError: could not convert string to float: 'x'"
    where = f".*test_reliability.py:{parse_reward.__code__.co_firstlineno + 1}"  # its line that raised
    with pytest.raises(SystemExit, match=f"{message} \\({where}\\); there is no checkpoint to resume: fix it"):
        main(run_args(world, out, "--max_steps=1", "--reward_funcs=test_reliability:parse_reward"))
    with pytest.raises(RewardFunctionError, match=message) as raised:
        main(run_args(world, out, "--max_steps=1", "--reward_funcs=test_reliability:parse_reward", "--debug"))
    assert "parse_reward" in [frame.name for frame in traceback.extract_tb(raised.value.__cause__.__traceback__)]
    assert not out.exists()  # no lock, no empty folder


def test_splits_of_different_types_are_named_and_both_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    train_rows = {"question_zh-cn": ["q1", "q2"], "answer_only": pa.array([1234, 3], pa.int64())}
    test_rows = {"question_zh-cn": ["q3", "q4"], "answer_only": ["1,234", "3.0"], "source": ["a", "b"]}
    pq.write_table(pa.table(train_rows), tmp_path / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table(test_rows), tmp_path / "data" / "test-00000-of-00001.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_split = GSM8KDataset(str(tmp_path), None, split="train")
        test_split = GSM8KDataset(str(tmp_path), None, split="test")
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"split 'test' of {str(tmp_path)!r} differs from 'train': answer_only is string there, int64 in train; "
        "source is only there (each split is read on its own)"
    ]
    assert [train_split[0]["answer"], test_split[0]["answer"], test_split[1]["answer"]] == [1234, "1,234", "3.0"]
    assert is_correct("<answer>\n1234\n</answer>", test_split[0]["answer"])


# ---------- hints and warnings ----------
def test_the_long_prompt_warning_comes_once_with_a_running_count_in_the_step_log(make_trainer):
    trainer = make_trainer(max_prompt_length=10, max_steps=2, eval_steps=100, save_steps=100)
    encoded, encode = [], trainer.encode_prompts

    def counting(prompts):  # every prompt is longer than 10 tokens: the system prompt alone is
        encoded.append(len(prompts))
        return encode(prompts)

    trainer.encode_prompts = counting
    counts, log_step = [], trainer.log_step
    trainer.log_step = lambda metrics: (counts.append(sum(encoded)), log_step(metrics))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    long_prompt = [w for w in caught if "max_prompt_length=10" in str(w.message)]
    assert len(long_prompt) == 1
    assert [record["truncated_prompts"] for record in trainer.history] == counts and counts[0] > 4
