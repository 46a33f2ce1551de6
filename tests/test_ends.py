"""How a run ends when something outside its step goes wrong (issue 46, item 6), each in one line that names what
happened and what comes next: a reward function that hangs under the default settings; a run stopped before its
first checkpoint, whose advice is a command that then runs; a worker of a torchrun job that is killed, or whose
reward function hangs, seen from the rank that is left."""

import errno
import glob
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from dapo_utils import distributed, time_limits
from dapo_utils.checkpoints import find_checkpoints
from dapo_utils.curves import read_jsonl
from dapo_utils.options import run_command
from test_multinode import children, finish, start, torchrun, train_args, wait_for
from train import main

SPEED = 1000  # the fast clock's seconds per real second
PROGRESS = ("Generating", "Loading", "Writing")  # the progress bars of datasets and transformers on stderr


def hangs(prompts, responses, answers):
    """A reward function that hangs (found on sys.path as test_ends:hangs); one that is not stopped fails after
    20 s instead of holding the test."""
    time.sleep(20)
    raise AssertionError("not stopped")


def stderr_lines(pattern):
    """The lines of the one stderr file torchrun's --log-dir holds at pattern, without progress bars."""
    (path,) = glob.glob(pattern)
    with open(path) as f:
        return [line for line in f.read().splitlines() if line.strip() and not line.startswith(PROGRESS)]


@pytest.fixture
def fast_clock(monkeypatch):
    """time_limits' clock and interval timer SPEED times faster than the wall clock: a limit of S seconds fires
    after S / SPEED real ones. Only time_limits sees it."""
    real_timer, real_clock = time_limits.signal.setitimer, time_limits.time.monotonic
    timer = lambda which, seconds: real_timer(which, seconds and max(seconds / SPEED, 1e-4))  # noqa: E731
    fast = SimpleNamespace(
        SIGALRM=signal.SIGALRM, ITIMER_REAL=signal.ITIMER_REAL, signal=signal.signal, setitimer=timer
    )
    monkeypatch.setattr(time_limits, "signal", fast)
    monkeypatch.setattr(time_limits, "time", SimpleNamespace(monotonic=lambda: real_clock() * SPEED))


def test_a_reward_function_that_hangs_under_the_default_settings_is_stopped_and_named(world, tmp_path, fast_clock):
    """The default reward_timeout, 600 s (10 real minutes; 0.6 s on the fast clock), stops the trial call of a
    reward function that never returns, before the model loads, and names it."""
    out = tmp_path / "out"
    argv = [*train_args(world, out), "--reward_funcs=test_ends:hangs"]
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == (
        "error: reward function hangs ran past reward_timeout=600.0 s on 2 responses: make it faster, or raise "
        f"reward_timeout (0 = no limit); there is no checkpoint to resume: fix it, then start the run again with "
        f"{run_command()} {shlex.join(argv)}"
    )
    assert time.monotonic() - started < 60 and not out.exists()


def test_a_full_disk_before_the_first_checkpoint_names_a_command_that_then_runs(world, tmp_path, monkeypatch):
    """Step 1's metrics line does not fit; the first checkpoint would come at step 2. The run has written its step-0
    evaluation, so the same command is refused (the folder holds this run's logs); the printed one clears them."""
    out, write = tmp_path / "out", os.write
    argv = train_args(world, out, max_steps=2, save_steps=2)

    def metrics_do_not_fit(descriptor, data):
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith("metrics.jsonl"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(descriptor, data)

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", metrics_do_not_fit)
        with pytest.raises(SystemExit) as stopped:
            main(argv)
    command = f"{run_command()} {shlex.join(argv)} --overwrite_output_dir=true"
    assert stopped.value.code == (
        f"error: could not write the log {out}/metrics.jsonl (No space left on device); its last line was not "
        f"written, the lines before are whole; there is no checkpoint to resume: free space, then start the run "
        f"again with {command}"
    )
    with pytest.raises(SystemExit, match="holds the logs and model of an earlier run"):
        main(argv)
    trainer = main(shlex.split(command)[2:])  # the printed command, after its `.venv/bin/python train.py`
    assert trainer.update_steps == 2 and [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_a_killed_worker_is_one_line_on_the_rank_left_and_the_restart_ends_the_run(world, tmp_path):
    """torchrun --max-restarts=1 ... --resume=auto, rank 0 killed (SIGKILL) once a checkpoint exists: rank 1's
    collective raises gloo's "Connection reset by peer" (a 30-line traceback before); its stderr is one line
    naming the rank that died and the restart, and the restarted job resumes and trains to the end."""
    out, logs = tmp_path / "run", tmp_path / "ranks"
    command = torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=1", f"--log-dir={logs}", "--redirects=2")
    process = start([*command, "train.py", "--resume=auto", *train_args(world, out)], tmp_path / "log")

    def workers():  # {rank: pid} of both, once a checkpoint exists
        running = children(process.pid, "train.py")
        return find_checkpoints(out) and len(running) == 2 and running

    os.kill(wait_for(workers, process, tmp_path / "log")[0], signal.SIGKILL)
    status, output = finish(process, tmp_path / "log")
    assert status == 0, output[-4000:]
    lines = stderr_lines(f"{logs}/*/attempt_0/1/stderr.log")  # rank 1 of the first attempt
    assert lines == ["rank 1: rank 0 is gone (its process ended); torchrun starts the job again (restart 1 of 1)"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, 9))


def slow_on_rank_1(prompts, responses, answers):
    """A reward function that hangs on rank 1 alone (found as test_ends:slow_on_rank_1, tests/ on PYTHONPATH)."""
    if os.environ.get("RANK") == "1":
        time.sleep(60)
    return [0.0] * len(responses)


def test_a_reward_that_hangs_on_one_rank_is_named_there_and_the_other_rank_says_it_is_gone(world, tmp_path):
    """Under torchrun the hung rank stops at reward_timeout (its trial call, before training) and names the function;
    rank 0, whose collective loses it, ends in one line too: rank 1 gone, or torchrun's SIGTERM while starting."""
    out, logs = tmp_path / "run", tmp_path / "ranks"
    command = torchrun("--standalone", "--nproc_per_node=2", f"--log-dir={logs}", "--redirects=2", "train.py")
    argv = [*train_args(world, out), "--reward_funcs=test_ends:slow_on_rank_1", "--reward_timeout=2"]
    tests = os.path.dirname(os.path.abspath(__file__))
    status, _ = finish(start([*command, *argv], tmp_path / "log", {"PYTHONPATH": tests}), tmp_path / "log")
    first, second = (stderr_lines(f"{logs}/*/attempt_0/{rank}/stderr.log") for rank in (0, 1))
    again = f"start the run again with {run_command(2)} {shlex.join(argv)}"
    assert status != 0 and second == [
        "error: reward function slow_on_rank_1 ran past reward_timeout=2.0 s on 2 responses: make it faster, or raise "
        f"reward_timeout (0 = no limit); there is no checkpoint to resume: fix it, then {again}"
    ]
    gone = f"rank 0: rank 1 is gone (its process ended); there is no checkpoint to resume: {again}"
    assert len(first) == 1 and first[0] in (
        gone,
        "stopped by SIGTERM while starting: nothing was trained; run the same command again",
    )


def test_the_dead_peer_line_names_the_ranks_whose_process_ended_and_the_command_once_restarts_are_spent(monkeypatch):
    """Rank 1 of 4: rank 0's process is a zombie torchrun has not reaped yet, rank 2's is reaped, rank 3 runs on
    another node (unnamed). With --max-restarts spent, the line ends in the command that continues. Of two ranks,
    the other is named even when its process has not ended here (another node, or still exiting)."""
    zombie, reaped = (subprocess.Popen([sys.executable, "-c", ""]) for _ in range(2))
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    reaped.wait()
    host = socket.gethostname()
    processes = [(host, zombie.pid), (host, os.getpid()), (host, reaped.pid), ("another-node", os.getpid())]
    monkeypatch.setattr(distributed, "PROCESSES", processes)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    advice = "the newest checkpoint is checkpoint_2 (step 2): continue with torchrun --nproc_per_node=4 train.py ..."
    assert distributed.peer_lost_line(advice) == f"rank 1: ranks 0, 2 are gone (their processes ended); {advice}"
    zombie.wait()
    monkeypatch.setattr(distributed, "EXIT_WAIT", 0.05)  # for processes that never end
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    restart = "torchrun starts the job again (restart 1 of 1)"
    monkeypatch.setattr(distributed, "PROCESSES", processes[1:2] + processes[3:])  # rank 1 of 2: the other elsewhere
    assert distributed.peer_lost_line(advice) == f"rank 1: rank 0 is gone (its connection closed); {restart}"
    monkeypatch.setattr(distributed, "PROCESSES", processes[1:2] + processes[3:] * 2)  # rank 1 of 3: none ended here
    assert distributed.peer_lost_line(advice) == f"rank 1: another rank is gone; {restart}"
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    gloo = "[pair.cc:537] Read error [127.0.0.1]:24705: Connection reset by peer. This is typically caused by ..."
    assert distributed.peer_lost(RuntimeError(gloo)) and not distributed.peer_lost(RuntimeError("CUDA out of memory"))
