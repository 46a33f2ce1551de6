"""Faults at the edges (issue 41), a test per row of its table, each as an operator meets it: a full disk at start,
at resume's log cut, at a log line and at the final model; a user's reward function that raises or returns what is
no number; a hand-edited checkpoint; SIGHUP, signals during start-up and a second Ctrl-C; tiny and malformed data
sets; a moved run folder; the project's warnings, the lock's mode and the end-of-run summary. Each ends in one line
that says what happened, what is intact and what to run, and leaves no lock, no .tmp file and no empty folder.

A full disk is a patched writer raising ENOSPC (or a Rust "No space left" error) where the real one would; a
signal is a real one, sent to this process (a test handler catches any the code under test leaves unhandled) or,
for the exit status of a start-up killed by SIGTERM, to a child process while it loads."""

import contextlib
import errno
import importlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import safetensors
import transformers

import train
from dapo_utils import checkpoints, run_dir
from dapo_utils.checkpoints import moved_path, write_checksums
from dapo_utils.evaluation import accuracy_summary
from dapo_utils.guards import check_rounds
from dapo_utils.notices import DapoWarning, one_line_warnings
from dapo_utils.rewards import RewardFunctionError
from dapo_utils.tiny_world import make_problems
from dapo_utils.writes import WriteFailed, append_log
from dapo_utils.options import run_command
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"
DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words


def run_args(world, out, *extra):
    model_dir, data_dir = world
    return [f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={out}", "--device=cpu",
            "--max_generate_length=8", "--eval_samples=4", "--eval_batch_size=4", "--lr=1e-3", "--eval_steps=100",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(world, tmp_path_factory):
    """A run of two steps: checkpoint_1 (weights), checkpoint_2 (weights and trainer state), its logs, its model."""
    out = tmp_path_factory.mktemp("finished") / "out"
    main(run_args(world, out, "--max_steps=2", "--save_steps=1"))
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """This test's own copy of finished_run."""
    return shutil.copytree(finished_run, tmp_path / "out")


def error_line(raised):
    """The one line a SystemExit prints."""
    message = str(raised.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


def steps_in(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def leftovers(folder):
    """What a failed command must not leave: a lock, a .tmp file or folder."""
    return sorted(p.name for p in folder.rglob("*") if p.name == "train.lock" or p.name.endswith(".tmp"))


class SignalReached(Exception):
    """A stop signal reached a handler of the test's: the code under test installed none of its own."""


@contextlib.contextmanager
def signals_guarded():
    """Ctrl-C, SIGTERM and SIGHUP sent to this process raise SignalReached where the code under test does not handle
    them itself, so that an unhandled one fails the test instead of ending pytest."""

    def reached(signum, frame):
        raise SignalReached(signal.Signals(signum).name)

    previous = {number: signal.signal(number, reached) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---------- a full disk: at start, at resume's log cut, at a log line, at the final model ----------
def test_a_full_disk_at_start_leaves_no_lock_and_an_empty_lock_is_a_dead_holders(run_copy, monkeypatch, capsys):
    out = run_copy

    def no_space(descriptor, data):  # the lock file is created (an inode), its record does not fit
        raise OSError(errno.ENOSPC, NO_SPACE)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", no_space)
        with pytest.raises(SystemExit) as raised:
            main(["--resume=latest", f"--output_dir={out}"])
    assert error_line(raised) == (
        f"error: cannot write to output_dir '{out}' ({NO_SPACE}); nothing was written: free space there, or choose "
        "another --output_dir"
    )
    assert leftovers(out) == []
    (out / "train.lock").write_text("")  # as an earlier version left it: space freed, the same command again
    assert main(["--resume=latest", f"--output_dir={out}"]).update_steps == 2
    notice = f"taking over {out}/train.lock, the lock that names no run (empty: one killed while starting?)"
    assert notice in capsys.readouterr().out and leftovers(out) == []


def test_the_lock_file_is_0644(tmp_path):
    umask = os.umask(0)  # what the process asks for, not what a umask makes of it
    try:
        assert run_dir.lock_refusal(str(tmp_path), take_over=False) == ""
    finally:
        os.umask(umask)
    assert oct((tmp_path / "train.lock").stat().st_mode & 0o777) == "0o644"


def test_a_full_disk_at_the_log_cut_a_log_line_and_the_final_model_names_the_checkpoint_to_resume(
    run_copy, monkeypatch
):
    out, before = run_copy, {name: (run_copy / name).read_bytes() for name in ("training_losses.txt", "metrics.jsonl")}
    real_open = open

    def tmp_file_full(path, mode="r", *args, **kwargs):  # resume's rewrite of a log: created, nothing fits
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and str(path).endswith(".txt.tmp"):
            f.close()
            raise OSError(errno.ENOSPC, NO_SPACE)
        return f

    resume = checkpoints.checkpoint_path(str(out), 2)
    advice = f"the newest checkpoint is checkpoint_2 (step 2): free space, then continue with {run_command()} "
    advice += f"--resume={resume}"
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "open", tmp_file_full, raising=False)
        with pytest.raises(SystemExit) as raised:
            main(["--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert error_line(raised) == (
        f"error: could not write the log cut back to the checkpoint's step {out}/training_losses.txt.tmp ({NO_SPACE}); "
        f"{out}/training_losses.txt is as it was; {advice}"
    )
    assert leftovers(out) == [] and before == {name: (out / name).read_bytes() for name in before}

    write = os.write

    def half_a_metrics_line(descriptor, data):  # the disk fills in the middle of the step's record
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith("metrics.jsonl"):
            write(descriptor, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, NO_SPACE)
        return write(descriptor, data)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", half_a_metrics_line)
        with pytest.raises(SystemExit) as raised:
            main(["--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert error_line(raised) == (
        f"error: could not write the log {out}/metrics.jsonl ({NO_SPACE}); its last line was not written, the lines "
        f"before are whole; {advice}"
    )
    assert (out / "metrics.jsonl").read_bytes() == before["metrics.jsonl"] and leftovers(out) == []

    save_file = transformers.modeling_utils.safe_save_file

    def final_model_full(tensors, path, *args, **kwargs):
        if "final_model.tmp" in str(path):
            raise safetensors.SafetensorError(DISK_FULL)
        return save_file(tensors, path, *args, **kwargs)

    earlier = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", final_model_full)
    with pytest.raises(SystemExit) as raised:  # step 3 trained, not checkpointed (save_steps=1 came from the run)
        main(["--resume=latest", f"--output_dir={out}", "--max_steps=3", "--save_steps=100"])
    assert error_line(raised) == (
        f"error: could not write the final model to {out}/final_model.tmp ({DISK_FULL}); {out} keeps its earlier "
        f"files; the weights of step 3 are in no checkpoint; {advice}"
    )
    assert (out / "model.safetensors").read_bytes() == earlier and leftovers(out) == [] and steps_in(out) == [1, 2, 3]


def test_a_final_model_that_does_not_fit_without_a_checkpoint_says_the_weights_are_lost(world, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(world[0])
    tokenizer = transformers.AutoTokenizer.from_pretrained(world[0])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, NO_SPACE)

    model.save_pretrained = no_space
    with pytest.raises(WriteFailed) as raised:
        checkpoints.save_final_model(model, tokenizer, str(tmp_path), step=1)
    assert str(raised.value) == (
        f"could not write the final model to {tmp_path}/final_model.tmp ({NO_SPACE}); {tmp_path} keeps its earlier "
        "files; no checkpoint holds this run's weights: they are lost"
    )
    assert checkpoints.resume_advice(str(tmp_path), "free space", "python train.py", "python train.py --x") == (
        "there is no checkpoint to resume: free space, then start the run again with python train.py --x"
    )
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_a_log_line_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    append_log(str(tmp_path), "metrics.jsonl", '{"step": 1}')
    write = os.write

    def five_bytes_fit(descriptor, data):
        write(descriptor, data[:5])
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(os, "write", five_bytes_fit)
    with pytest.raises(WriteFailed, match="could not write the log .*metrics.jsonl \\(No space left on device\\)"):
        append_log(str(tmp_path), "metrics.jsonl", '{"step": 2, "loss": 0.5}')
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


# ---------- a user's reward function that raises or returns what is no number ----------
REWARDS = """\
import json

CALLS = {"count": 0, "fail_at": 1}


def read_config(text):
    return json.loads(text)  # json's own frames raise; this line is the user's


def raise_on_call(prompts, responses, answers):
    CALLS["count"] += 1
    if CALLS["count"] == CALLS["fail_at"]:
        read_config("{")
    return [float(i % 2) for i in range(len(responses))]


def says_high(prompts, responses, answers):
    return ["high" for _ in responses]
"""


def test_a_reward_function_that_raises_or_returns_strings_ends_in_one_line(world, run_copy, tmp_path, monkeypatch):
    (tmp_path / "edge_rewards_41.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = importlib.import_module("edge_rewards_41")
    where = f"{tmp_path}/edge_rewards_41.py:7"  # read_config's line, not json's
    boom = f"JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) ({where})"
    fresh = tmp_path / "fresh"
    argv = run_args(world, fresh, "--reward_funcs=edge_rewards_41:raise_on_call")
    with pytest.raises(SystemExit) as raised:  # call 1: its trial on two rows, before the model loads
        main(argv)
    assert error_line(raised) == (
        f"error: reward function raise_on_call raised {boom}; there is no checkpoint to resume: fix it, then start "
        f"the run again with {run_command()} {shlex.join(argv)}"
    )
    assert not fresh.exists()  # no lock, no empty folder
    for debug in (["--debug"], []):  # --debug, or DAPO_DEBUG=1: the traceback, the user's error as its cause
        rewards.CALLS.update(count=0)
        with monkeypatch.context() as patch:
            patch.setenv("DAPO_DEBUG", "0" if debug else "1")
            with pytest.raises(RewardFunctionError) as raised:
                main(run_args(world, fresh, "--reward_funcs=edge_rewards_41:raise_on_call", *debug))
        assert type(raised.value.__cause__).__name__ == "JSONDecodeError" and not fresh.exists()

    rewards.CALLS.update(count=0, fail_at=2)  # call 2: the first sampling round after the resume
    with pytest.raises(SystemExit) as raised:
        main(
            [
                "--resume=latest",
                f"--output_dir={run_copy}",
                "--max_steps=3",
                "--reward_funcs=edge_rewards_41:raise_on_call",
            ]
        )
    assert error_line(raised) == (
        f"error: reward function raise_on_call raised {boom}; the newest checkpoint is checkpoint_2 (step 2): fix it, "
        f"then continue with {run_command()} --resume={run_copy}/checkpoint_2"
    )
    argv = run_args(world, fresh, "--reward_funcs=edge_rewards_41:says_high")
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert error_line(raised) == (
        "error: reward function says_high returned 'high' (str) for response 0 of 2: return one number per response "
        f"(None: no opinion); there is no checkpoint to resume: fix it, then start the run again with {run_command()} "
        f"{shlex.join(argv)}"
    )


# ---------- checkpoints edited by hand ----------
def test_an_edited_dapo_args_json_is_checked_by_key_and_type_and_a_damaged_trainer_state_offers_its_weights(run_copy):
    out = run_copy
    args_file = out / "checkpoint_2" / "dapo_args.json"
    saved = json.loads(args_file.read_text())
    for change, line in [  # checksums.json as the run wrote it: the edit alone is named
        ({"lora_rank": 8}, f"{args_file} has the key 'lora_rank', which is no DapoArguments field: remove it"),
        ({"lr": "1e-3"}, f"{args_file}: lr = '1e-3' is not of its type (float): correct or remove it"),
    ]:
        args_file.write_text(json.dumps(saved | change))
        with pytest.raises(SystemExit) as raised:
            main(["--resume=latest", f"--output_dir={out}"])
        assert error_line(raised) == f"error: {line}"
    args_file.write_text(json.dumps(saved | {"batch_size": 2}))  # a step setting: refused, named
    with pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}"])
    assert error_line(raised) == (
        f"error: cannot resume {out}/checkpoint_2 with other step settings: batch_size (1 -> 2) (given on the "
        "command line or edited in its dapo_args.json); put them back, or start a new run"
    )
    args_file.write_text(json.dumps(saved | {"lr": 2e-3}))  # an optimizer setting: the edit applies
    resumed = main(["--resume=latest", f"--output_dir={out}", "--max_steps=3"])
    assert resumed.args.lr == 2e-3 and resumed.optimizer.param_groups[0]["lr"] == 2e-3 and steps_in(out) == [1, 2, 3]

    state = out / "checkpoint_3" / "trainer_state.pt"  # a flipped byte inside it: checkpoint_3's weights are intact
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 1
    state.write_bytes(data)
    with pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}"])
    assert error_line(raised) == (
        f"error: {state} is damaged (its sha256 is not the one in checksums.json: changed since it was written); no "
        f"intact checkpoint keeps a trainer state; start a new run from the weights of checkpoint_3: "
        f"--model_path={out}/checkpoint_3"
    )


# ---------- signals: SIGHUP mid-run, a second Ctrl-C, Ctrl-C and SIGTERM during start-up ----------
def test_sighup_stops_with_a_checkpoint_and_a_second_ctrl_c_names_the_newest(run_copy, monkeypatch, capsys):
    out, train_step = run_copy, train.DapoTrainer.train_step
    sent = []

    def signals_in_step_3(self, *args, **kwargs):  # the terminal closes in the middle of a step
        if self.update_steps == 2 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGHUP))
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(train.DapoTrainer, "train_step", signals_in_step_3)
    with signals_guarded(), pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}", "--max_steps=5"])
    printed = capsys.readouterr().out
    assert raised.value.code == 130 and steps_in(out) == [1, 2, 3] and leftovers(out) == []
    assert (
        "SIGHUP: stopping with a checkpoint of the last finished step (Ctrl-C again: stop now, no checkpoint)"
        in printed
    )
    assert f"stopped; continue with: {run_command()} --resume={out}/checkpoint_3" in printed

    def two_ctrl_c_in_step_4(self, *args, **kwargs):
        if self.update_steps == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(train.DapoTrainer, "train_step", two_ctrl_c_in_step_4)  # once per micro-batch: twice
    with signals_guarded(), pytest.raises(SystemExit) as raised:
        main(["--resume=latest", f"--output_dir={out}", "--max_steps=5"])
    assert raised.value.code == 130 and leftovers(out) == []
    assert capsys.readouterr().err.splitlines()[-1] == (
        "stopped by Ctrl-C again, at once, without a checkpoint of this step; the newest checkpoint is checkpoint_3 "
        f"(step 3): continue with {run_command()} --resume={out}/checkpoint_3"
    )


def test_a_sighup_that_nohup_ignores_stays_ignored(make_trainer):
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with checkpoints.deferred_interrupts(make_trainer()):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_ctrl_c_or_a_full_disk_while_the_demo_builds_its_world_leaves_nothing(tmp_path, monkeypatch, capsys):
    from dapo_utils import tiny_world

    def interrupted_build(root, *args, **kwargs):  # the data set written, the model not yet
        os.makedirs(os.path.join(root, "gsm8k_tiny", "data"))
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    monkeypatch.setattr(tiny_world, "build_tiny_world", interrupted_build)
    demo = tmp_path / "output" / "demo"
    with signals_guarded(), pytest.raises(SystemExit) as raised:
        main(["--demo", f"--output_dir={demo}"])
    assert raised.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "stopped by Ctrl-C while starting: nothing was trained; run the same command again"
    )
    assert os.listdir(tmp_path) == []  # output/ and output/demo were made by the run: gone with the lock

    def full_disk_build(root, *args, **kwargs):
        os.makedirs(os.path.join(root, "gsm8k_tiny", "data"))
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(tiny_world, "build_tiny_world", full_disk_build)
    with pytest.raises(SystemExit) as raised:
        main(["--demo", f"--output_dir={demo}"])
    assert error_line(raised) == (
        f"error: could not write the demo's world to {demo} ({NO_SPACE}); none of it is left; free space, then run "
        "the same command again"
    )
    assert os.listdir(tmp_path) == []


SLOW_LOAD = """
import pathlib, sys, time
sys.path.insert(0, {root!r})
import train
from dapo_utils import checkpoints

def slow_load(path):  # the model loads for a minute: the test sends SIGTERM meanwhile
    pathlib.Path({marker!r}).write_text("loading")
    time.sleep(60)

checkpoints.load_causal_lm = slow_load
train.main({argv!r})
"""


def test_sigterm_while_the_model_loads_exits_143_in_one_line_with_the_lock_released(world, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"  # a test split with a column more: a warning while the data loads
    data.mkdir()
    rows = make_problems(8, seed=0)
    train_rows = {key: [row[key] for row in rows] for key in ("question_zh-cn", "answer_only")}
    pq.write_table(pa.table(train_rows), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.table(train_rows | {"source": ["tiny"] * 8}), data / "test-00000-of-00001.parquet")
    out, marker = tmp_path / "run" / "out", tmp_path / "loading"
    argv = run_args((world[0], str(data)), out)
    script = SLOW_LOAD.format(root=ROOT, marker=str(marker), argv=argv)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), child.communicate()
        assert (out / "train.lock").exists()  # held while it loads
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    lines = [line for line in err.splitlines() if not line.startswith(("Generating", "Loading"))]
    assert child.returncode == 143 and "Traceback" not in err
    assert lines[-1] == "stopped by SIGTERM while starting: nothing was trained; run the same command again"
    warning = f"warning: split 'test' of {str(data)!r} differs from 'train': source is only there (each split is "
    assert f"\n{warning}read on its own)\n" in err
    assert "UserWarning" not in err and "warn(" not in err  # no file:line prefix, no echoed source line
    assert not (tmp_path / "run").exists()  # no lock, no empty folder: the same command runs again as it is


# ---------- small and malformed data sets, a moved run folder ----------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def test_small_and_malformed_data_sets_are_named_with_the_fix(world, tmp_path):
    out = tmp_path / "out"
    small = write_jsonl(tmp_path / "small.jsonl", make_problems(50, seed=0))
    with pytest.raises(SystemExit) as raised:
        main(run_args((world[0], str(small)), out))
    assert error_line(raised) == (
        f"error: split 'train' of '{small}' has 50 rows and the data set no test split: holding out test_size=100 "
        "rows as the test split would leave none to train on; give it a test split (a folder holding train.jsonl and "
        "test.jsonl, or train-*.parquet and test-*.parquet), or hold out fewer rows with --test_size=N"
    )
    assert not out.exists()
    assert main(run_args((world[0], str(small)), out, "--test_size=10", "--max_steps=1")).update_steps == 1

    one_left = write_jsonl(tmp_path / "one_left.jsonl", make_problems(101, seed=0))
    with pytest.raises(SystemExit) as raised:
        main(run_args((world[0], str(one_left)), tmp_path / "b"))
    assert error_line(raised) == (
        f"error: the training split of '{one_left}' has 1 row, fewer than the 2 prompts one optimizer step takes "
        "(batch_size x gradient_accumulation_steps x steps_per_generation): add rows, lower these settings, or, "
        "where test rows are held out of it, hold out fewer with --test_size (now 100)"
    )
    assert leftovers(tmp_path / "b") == []

    bad = write_jsonl(tmp_path / "bad.jsonl", make_problems(2, seed=0))
    bad.write_text(bad.read_text() + '{"question_zh-cn": "x", "answer_only": }\n')
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.csv").write_text("question_zh-cn,answer_only\nq1,1\nq2,2,3\n")
    for data, line in [
        (
            bad,
            f"cannot read {bad}: line 3 is not a JSON object (Expecting value, at column 40): fix or remove that line",
        ),
        (folder, f"cannot read {folder}/train.csv: line 3 has 3 fields, the header 2: fix or remove that line"),
    ]:
        with pytest.raises(SystemExit) as raised:
            main(run_args((world[0], str(data)), tmp_path / "c"))
        assert error_line(raised) == f"error: {line}"
        assert not (tmp_path / "c").exists()


def test_a_moved_run_folder_resumes_with_its_model_and_data_inside_it(world, run_copy, tmp_path, capsys):
    first = tmp_path / "first"
    run_copy.rename(first)
    shutil.copytree(world[0], first / "model")
    shutil.copytree(world[1], first / "data")
    for checkpoint in ("checkpoint_1", "checkpoint_2"):  # as a run with its model and data inside its folder writes it
        args_file = first / checkpoint / "dapo_args.json"
        inside = {"model_path": f"{first}/model", "data_path": f"{first}/data", "output_dir": str(first)}
        args_file.write_text(json.dumps(json.loads(args_file.read_text()) | inside))
        write_checksums(first / checkpoint)
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    first.rename(moved)
    assert main(["--resume=latest", f"--output_dir={moved}"]).update_steps == 2
    printed = capsys.readouterr().out
    assert f"model_path '{first}/model' is gone: using '{moved}/model', at its place in the moved run folder" in printed
    assert f"data_path '{first}/data' is gone: using '{moved}/data'" in printed
    # a checkpoint of an earlier version saved output_dir as given: relative to the working directory of the time
    assert moved_path("/gone/cwd/output/demo/model", "./output/demo", str(moved)) == f"{moved}/model"
    assert moved_path("/gone/models/qwen", "./output/demo", str(moved)) == "/gone/models/qwen"  # outside: as it was


# ---------- messages in the project's voice ----------
def test_the_projects_warnings_are_one_line_and_others_keep_pythons_format(make_trainer):
    trainer = make_trainer()
    trainer.empty_rounds = 20
    with pytest.warns(DapoWarning) as caught:
        check_rounds(trainer, {})
    line = "the last 20 sampling rounds kept no group: filter_metric='reward' skips every group"
    with one_line_warnings():
        formatted = warnings.formatwarning(caught[0].message, DapoWarning, "guards.py", 69, "warn(...)")
        other = warnings.formatwarning("x", UserWarning, "elsewhere.py", 3, "warn('x')")
    assert formatted.startswith(f"warning: {line}") and formatted.count("\n") == 1
    assert other == warnings.formatwarning("x", UserWarning, "elsewhere.py", 3, "warn('x')")
    assert "elsewhere.py:3: UserWarning: x" in other


def test_transformers_long_sequence_warning_gives_way_to_the_projects(make_trainer):
    trainer = make_trainer(max_prompt_length=10)
    trainer.tokenizer.model_max_length = 16  # every chat-formatted prompt is longer
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with pytest.warns(DapoWarning, match="prompts longer than max_prompt_length=10 tokens lose their beginning"):
            trainer.encode_prompts([trainer.train_dataset[0]["prompt"]])
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "sequence length is longer" in r.getMessage()] == []


def test_a_summary_whose_last_step_was_not_evaluated_says_the_last_evaluated_one(tmp_path):
    (tmp_path / "accuracy_losses.txt").write_text("0,0.25\n")
    (tmp_path / "evaluations.jsonl").write_text('{"step": 0, "eval/accuracy_lenient": 0.5}\n')
    write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1}, {"step": 2}, {"step": 3}])
    assert accuracy_summary(str(tmp_path)) == (
        "held-out accuracy (strict / lenient)  step 0 0.25 / 0.50  (the last evaluated step, of 3 trained: it "
        "evaluates every --eval_steps steps)"
    )
