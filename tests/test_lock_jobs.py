"""Restarts on another host (issue 46, item 4): the lock records the job it belongs to (SLURM's job ID, torchrun's
run ID); a restart of the same job takes over a dead lock wherever it was held, another job's is still refused,
and a resume chooses its checkpoint once it holds the lock."""

import json
import os
import socket

import pytest

from dapo_utils import checkpoints, run_dir
from test_faults import error_line, run_args
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def another_hosts_lock(out, job):
    """output_dir/train.lock as rank 0 of a job on a node that is gone (a requeue or a restart moved the job)."""
    (out / "train.lock").write_text(json.dumps({"pid": 1, "host": "node-gone", "start": 1, "job": job}))


@pytest.fixture
def no_job(monkeypatch):
    for name in run_dir.JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_lock_records_the_job_slurms_before_torchruns(no_job):
    assert run_dir.job_id() is None
    no_job.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv_id, shared by unrelated jobs
    assert run_dir.job_id() is None and run_dir.this_process()["job"] is None
    no_job.setenv("TORCHELASTIC_RUN_ID", "4242")
    assert run_dir.this_process() == {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start": run_dir.process_start(os.getpid()),
        "job": "TORCHELASTIC_RUN_ID=4242",
    }
    no_job.setenv("SLURM_JOB_ID", "77")
    assert run_dir.job_id() == "SLURM_JOB_ID=77"


def test_a_restart_of_the_same_job_on_another_host_takes_its_dead_lock_over(world, tmp_path, no_job, capsys):
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1", "--save_steps=1", "--eval_steps=100"))
    no_job.setenv("SLURM_JOB_ID", "4242")  # as a requeued SLURM job's rank 0 has it, on another node
    another_hosts_lock(out, "SLURM_JOB_ID=4242")
    resumed = main(["--resume=auto", f"--output_dir={out}"])
    assert (
        f"taking over {out}/train.lock, the lock of PID 1 on host node-gone, another machine, of this job "
        "(SLURM_JOB_ID=4242), which restarted" in capsys.readouterr().out
    )
    assert resumed.update_steps == 1 and not (out / "train.lock").exists()  # released at its end

    for job in ("4243", None):  # the lock of another job, or seen from a process of none: refused
        no_job.delenv("SLURM_JOB_ID")
        if job:
            no_job.setenv("SLURM_JOB_ID", job)
        another_hosts_lock(out, "SLURM_JOB_ID=4242")
        with pytest.raises(SystemExit) as refused:
            main(["--resume=auto", f"--output_dir={out}"])
        assert error_line(refused) == (
            f"error: output_dir '{out}' has the lock of PID 1 on host node-gone, another machine, of another job "
            "(SLURM_JOB_ID=4242): if that run has ended: take it over with --take_over_lock"
        )
        assert run_dir.lock_holder(str(out / "train.lock"))["host"] == "node-gone"  # untouched


def test_a_live_process_of_the_same_job_on_this_host_keeps_its_lock(tmp_path, no_job):
    no_job.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / "train.lock").write_text(json.dumps(run_dir.this_process()))  # this process: it runs
    refusal = run_dir.lock_refusal(str(tmp_path), take_over=False, take_over_dead=True)
    assert refusal.startswith(f"error: output_dir '{tmp_path}' is in use by another run (PID {os.getpid()} on host")


def test_a_resume_chooses_its_checkpoint_with_the_lock_held(world, tmp_path, monkeypatch):
    """--resume=auto, latest and a path each find their checkpoint while this process holds output_dir's lock, so
    that no other run writes there meanwhile and a killed run's cut-short write is completed first."""
    out = tmp_path / "out"
    main(run_args(world, out, "--max_steps=1", "--save_steps=1", "--eval_steps=100"))
    holders = []
    find_checkpoint = checkpoints.find_checkpoint

    def finding(resume, output_dir):
        holders.append(run_dir.lock_holder(os.path.join(out, run_dir.LOCK_FILE)))
        return find_checkpoint(resume, output_dir)

    monkeypatch.setattr("dapo_utils.cli.find_checkpoint", finding)
    for resume in ("--resume=auto", "--resume=latest", f"--resume={out}/checkpoint_1"):
        main([resume, f"--output_dir={out}"] if "checkpoint_1" not in resume else [resume])
    assert holders == [run_dir.this_process()] * 3 and not (out / "train.lock").exists()
