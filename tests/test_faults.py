"""The faults of real clusters and real files, each ending in one line that names it, with nothing lost: SIGTERM
(preemption), a diverged run, a run whose sampling keeps no group, a full disk, an edited or damaged
checkpoint, a reused PID in a lock, a model with non-finite weights, Ctrl-C during the final save."""

import errno
import json
import os
import shutil
import signal
import socket
import sys

import matplotlib.figure
import pytest
import safetensors
import torch
import transformers
from safetensors.torch import load_file

import train
from dapo_utils import checkpoints
from dapo_utils.checkpoints import checkpoint_damage, write_checksums
from dapo_utils.options import run_command
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words


def run_args(world, out, *extra):
    model_dir, data_dir = world
    return [f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={out}", "--device=cpu",
            "--max_generate_length=8", "--eval_samples=4", "--eval_batch_size=4", "--lr=1e-3", "--eval_steps=100",
            *extra]  # fmt: skip


def steps_in(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def error_line(raised):
    """The one line a SystemExit prints."""
    message = str(raised.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


# ---------- 1. SIGTERM: preemption ----------
def test_sigterm_stops_with_a_checkpoint_and_resume_latest_equals_an_uninterrupted_run(
    world, tmp_path, monkeypatch, capsys
):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    main(run_args(world, whole, "--max_steps=3", "--save_steps=100"))
    train_step = train.DapoTrainer.train_step

    def sigterm_in_step_2(self, *args, **kwargs):  # SLURM's notice, once, in the middle of a step
        if self.update_steps == 1 and not self.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(train.DapoTrainer, "train_step", sigterm_in_step_2)
        with pytest.raises(SystemExit) as raised:
            main(run_args(world, stopped, "--max_steps=3", "--save_steps=100"))
    out = capsys.readouterr().out
    assert raised.value.code == 130 and steps_in(stopped) == [1, 2]  # step 2 finished
    assert (
        "SIGTERM: stopping with a checkpoint of the last finished step (Ctrl-C again: stop now, no checkpoint)" in out
    )
    assert f"stopped; continue with: {run_command()} --resume={stopped}/checkpoint_2" in out
    assert not (stopped / "train.lock").exists()
    host = socket.gethostname()
    (stopped / "train.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "start": 1}))
    with pytest.raises(SystemExit) as raised:  # a lock of another machine's run: only --take_over_lock
        main(["--resume=latest", f"--output_dir={stopped}"])
    assert error_line(raised) == (
        f"error: output_dir '{stopped}' has the lock of PID 1 on host elsewhere, another machine: if that run has "
        "ended: take it over with --take_over_lock"
    )
    # A lock of this host whose PID now belongs to another process (this one): its start time tells them apart.
    (stopped / "train.lock").write_text(json.dumps({"pid": os.getpid(), "host": host, "start": 1}))
    resumed = main(["--resume=latest", f"--output_dir={stopped}"])  # no --take_over_lock
    out = capsys.readouterr().out
    assert (
        f"taking over {stopped}/train.lock, the lock of PID {os.getpid()} on host {host}, which no longer runs" in out
    )
    assert resumed.update_steps == 3 and steps_in(stopped) == [1, 2, 3]
    final, expected = weights(stopped), weights(whole)
    assert all(torch.equal(final[name], expected[name]) for name in expected)


# ---------- 2. divergence and starvation ----------
def test_lr_1e3_on_the_demo_stops_at_the_divergence_naming_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "demo"
    demo = ["--demo", f"--output_dir={out}", "--lr=1e3", "--max_steps=3", "--save_steps=1"]
    with pytest.raises(SystemExit) as raised:
        main([*demo, "--eval_samples=4", "--eval_steps=100", "--max_generate_length=12"])
    assert error_line(raised) == (
        "error: the run diverged at step 2: the gradient norm is nan, stopped before the optimizer step; likely "
        f"causes: too high a learning rate (lr=1000), rewards of a large scale (reward_weights); the last good "
        f"checkpoint: --resume={out}/checkpoint_1"
    )
    assert sorted(p.name for p in out.glob("checkpoint_*")) == ["checkpoint_1"] and steps_in(out) == [1]
    assert all(t.isfinite().all() for t in weights(out / "checkpoint_1").values())
    assert (out / "checkpoint_1" / "trainer_state.pt").exists() and not (out / "model.safetensors").exists()


BROKEN_AFTER = []  # the checkpoint after which none_after_step_1 breaks


def none_after_step_1(prompts, responses, answers):  # a reward that breaks: None (no opinion) for everything
    broken = BROKEN_AFTER and os.path.exists(BROKEN_AFTER[0])
    return [None if broken else float(i % 2) for i in range(len(responses))]


def test_sampling_that_keeps_no_group_stops_naming_what_it_saw(world, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BROKEN_AFTER", [tmp_path / "out" / "checkpoint_1"])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as raised:
        main(
            run_args(
                world, out, "--reward_funcs=test_faults:none_after_step_1", "--save_steps=1", "--max_empty_rounds=6"
            )
        )
    assert error_line(raised) == (
        "error: 6 sampling rounds in a row kept no group after step 1: seen: none_after_step_1 returned None or NaN "
        "for every response, every reward was 0; filter_metric='reward' skips every group whose responses all "
        "score the same; check the reward functions, use an easier data set or a stronger model, or "
        f"filter_metric='none'; the last good checkpoint: --resume={out}/checkpoint_1 (max_empty_rounds=6; 0 = "
        "no limit)"
    )
    cold = tmp_path / "cold"
    with pytest.raises(SystemExit) as raised:
        main(run_args(world, cold, "--temperature=1e-6", "--max_empty_rounds=4"))  # 2 prompt batches a call
    assert error_line(raised).startswith(
        "error: 4 sampling rounds in a row kept no group after step 0: seen: temperature=1e-06 is near zero, a "
        "collapsed policy (4 of 4 groups: 4 identical responses)"
    )
    assert error_line(raised).endswith("; no checkpoint yet (max_empty_rounds=4; 0 = no limit)")


def test_ctrl_c_between_sampling_rounds_stops_with_a_checkpoint(make_trainer, capsys):
    trainer = make_trainer(reward_funcs=[lambda prompts, responses, answers: [1.0] * len(responses)], epoch=1)
    generate, calls = trainer.generate_experiences, []

    def ctrl_c_in_call_3(inputs):  # every group is skipped: no step end comes
        calls.append(len(inputs["prompt"]))
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return generate(inputs)

    trainer.generate_experiences = ctrl_c_in_call_3
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert calls == [2, 2, 2] and trainer.state.batches_done == 6  # 2 prompt batches of 1 a call: a step's worth
    out = trainer.args.output_dir
    assert f"stopped; continue with: {run_command()} --resume={out}/checkpoint_0" in capsys.readouterr().out
    saved = torch.load(os.path.join(out, "checkpoint_0", "trainer_state.pt"), weights_only=True)
    assert saved["loop"]["batches_done"] == 6  # a resume goes on with the 7th prompt batch


# ---------- 3. a full disk ----------
def test_a_full_disk_anywhere_is_one_line_and_keeps_what_was_written(world, tmp_path, monkeypatch):
    save_file = transformers.modeling_utils.safe_save_file
    full = []  # the folders whose weights no longer fit

    def disk_full_in(tensors, path, *args, **kwargs):
        if any(folder in str(path) for folder in full):
            raise safetensors.SafetensorError(DISK_FULL)
        return save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full_in)
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1"))  # an earlier run's final model
    earlier = (out / "model.safetensors").read_bytes()
    full.append("checkpoint_2")
    with pytest.raises(SystemExit) as raised:
        main(run_args(world, out, "--max_steps=3", "--save_steps=1", "--overwrite_output_dir=true"))
    assert error_line(raised) == (
        f"error: could not write checkpoint_2 (disk full?): {DISK_FULL}; the newest checkpoint is checkpoint_1 (step "
        f"1): free space, then continue with {run_command()} --resume={out}/checkpoint_1"
    )
    assert checkpoint_damage(out / "checkpoint_1") == ""  # weights, trainer state, arguments, checksums
    assert not (out / "checkpoint_2.tmp").exists() and not (out / "train.lock").exists()
    full.append("final_model.tmp")
    with pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}", "--max_steps=1"])
    assert (out / "model.safetensors").read_bytes() == earlier and not (out / "final_model.tmp").exists()
    # (a resume at max_steps trains no further: it writes its final model from the checkpoint's weights)
    assert error_line(raised) == (
        f"error: could not write the final model to {out}/final_model.tmp ({DISK_FULL}); {out} keeps its earlier "
        f"files; the newest checkpoint is checkpoint_1 (step 1): free space, then continue with {run_command()} "
        f"--resume={out}/checkpoint_1"
    )

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", no_space)
    with pytest.raises(SystemExit) as raised:
        main([f"--plot={out}"])
    assert error_line(raised) == f"error: could not write the curves {out}/curves.png (No space left on device)"
    write = os.write

    def logs_full(descriptor, data):  # every log line
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith((".txt", ".jsonl")):
            no_space()
        return write(descriptor, data)

    monkeypatch.setattr(os, "write", logs_full)
    with pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}", "--max_steps=2"])
    assert error_line(raised) == (
        f"error: could not write the log {out}/training_losses.txt (No space left on device); its last line was not "
        "written, the lines before are whole; the newest checkpoint is checkpoint_1 (step 1): free space, then "
        f"continue with {run_command()} --resume={out}/checkpoint_1"
    )


# ---------- 4. damaged or foreign checkpoints, lock records, models, the final save ----------
def test_edited_and_damaged_checkpoints_are_named_before_anything_loads(world, tmp_path):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=1"))
    args_file = out / "checkpoint_2" / "dapo_args.json"
    saved = json.loads(args_file.read_text())
    for change, line in [
        ({"lora_rank": 8}, f"{args_file} has the key 'lora_rank', which is no DapoArguments field: remove it"),
        ({"lr": "1e-3"}, f"{args_file}: lr = '1e-3' is not of its type (float): correct or remove it"),
        (
            {"loss_agg_mode": "mean"},
            f"{args_file}: loss_agg_mode = 'mean' is not of its type (Literal['seed', "
            "'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum-norm']): correct or remove it",
        ),
    ]:
        args_file.write_text(json.dumps(saved | change))
        write_checksums(out / "checkpoint_2")  # as another version of train.py would write it
        with pytest.raises(SystemExit) as raised:
            main(["--resume=latest", f"--output_dir={out}"])
        assert error_line(raised) == f"error: {line}"
    args_file.write_text(json.dumps(saved))
    write_checksums(out / "checkpoint_2")
    model = out / "checkpoint_2" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one weight: the header still reads
    model.write_bytes(data)
    with pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}"])
    assert error_line(raised) == (
        f"error: {model} is damaged (its sha256 is not the one in checksums.json: changed since it was written); "
        f"no intact checkpoint keeps a trainer state; start a new run from the weights of checkpoint_1: "
        f"--model_path={out}/checkpoint_1"
    )


def test_eval_only_checks_both_models_first_and_refuses_non_finite_weights(world, tmp_path, monkeypatch):
    model_dir, data_dir = world
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    evaluate = ["--eval_only", f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={tmp_path}"]
    with monkeypatch.context() as patch:
        patch.setattr(
            checkpoints, "load_causal_lm", lambda path: pytest.fail("a model loaded before both were checked")
        )
        with pytest.raises(SystemExit) as raised:
            main([*evaluate, f"--compare={gguf}", "--use_vllm=true"])
        assert error_line(raised) == f"error: --compare '{gguf}': use_vllm cannot load a .gguf model: convert it first"
        damaged = tmp_path / "damaged"
        shutil.copytree(model_dir, damaged)
        (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:100])
        with pytest.raises(SystemExit) as raised:
            main([*evaluate, f"--compare={damaged}"])
        assert error_line(raised).startswith(f"error: --compare: {damaged}/model.safetensors is damaged (")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "nan_model")
    with pytest.raises(SystemExit) as raised:
        main([*evaluate[:1], f"--model_path={tmp_path / 'nan_model'}", *evaluate[2:], "--eval_samples=4"])
    assert error_line(raised) == (
        f"error: {tmp_path / 'nan_model'} has non-finite weights (model.norm.weight): a diverged run's model? "
        "evaluate an earlier checkpoint"
    )


def test_ctrl_c_during_the_final_save_keeps_the_earlier_model_whole(world, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1"))
    before = {name: (out / name).read_bytes() for name in ("model.safetensors", "tokenizer.json")}
    save_pretrained = transformers.PreTrainedTokenizerBase.save_pretrained

    def ctrl_c_after_the_weights(self, folder, *args, **kwargs):  # the weights are written, the tokenizer not
        if str(folder).endswith("final_model.tmp"):
            os.kill(os.getpid(), signal.SIGINT)
        return save_pretrained(self, folder, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", ctrl_c_after_the_weights)
    with pytest.raises(SystemExit) as raised:
        main(run_args(world, out, "--max_steps=2", "--save_steps=2", "--overwrite_output_dir=true", "--seed=2"))
    assert raised.value.code == 130
    assert capsys.readouterr().err.endswith(
        f"stopped by Ctrl-C while writing the final model; {out} keeps its earlier files; the newest checkpoint is "
        f"checkpoint_2 (step 2): continue with {run_command()} --resume={out}/checkpoint_2\n"
    )
    assert before == {name: (out / name).read_bytes() for name in before} and not (out / "final_model.tmp").exists()
    monkeypatch.undo()
    main(["--resume=latest", f"--output_dir={out}"])  # at max_steps: the final model from checkpoint_2
    assert torch.equal(weights(out)["model.norm.weight"], weights(out / "checkpoint_2")["model.norm.weight"])
