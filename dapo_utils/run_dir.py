"""The output folder a run writes to: it holds the folder for the whole run (hold_output_dir, a lock file with
its PID, host, start time and job: lock_refusal, lock_holder, process_runs, job_id), and a fresh run claims it
(claim_output_dir: an earlier run's logs and checkpoints cleared with --overwrite_output_dir=true, else refused;
earlier_run says what is there); a run that ends before it wrote anything leaves no lock and no empty folder;
under torchrun every node must see it (unshared_folder: rank 0's lock, read on every rank). Used by launch.py
(every run) and tiny_world.py (the demo's own folder)."""

import contextlib
import errno
import json
import os
import shutil
import socket
import sys

from dapo_utils.checkpoints import LOG_FILES, complete_interrupted_saves, find_checkpoints

LOCK_FILE = "train.lock"  # in output_dir while a run writes there: {"pid": ..., "host": ..., "start": ..., "job": ...}
# What names the job a process belongs to, the same in each of its restarts: SLURM's job ID (kept by a requeue),
# else torchrun's run ID (--rdzv_id; a --standalone launch draws one for all its restarts). "none" is torchrun's
# default --rdzv_id, shared by unrelated jobs: no job.
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# a finished run's model in output_dir (with LoRA: its adapters)
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


def earlier_run(output_dir):
    """What an earlier run left in output_dir, in words ('' when nothing): a fresh run there would append to
    its logs, mix its checkpoints with --resume=latest's choice and overwrite its model."""
    checkpoints = find_checkpoints(output_dir)
    if checkpoints:
        return f"checkpoints of an earlier run (checkpoint_{max(checkpoints)})"
    found = [name for name in (*LOG_FILES, *MODEL_FILES) if os.path.exists(os.path.join(output_dir, name))]
    return f"the logs and model of an earlier run ({', '.join(found)})" if found else ""


def claim_output_dir(output_dir, may_clear, demo=False):
    """A fresh run starts in a folder without an earlier run's logs and checkpoints. may_clear
    (--overwrite_output_dir=true, or the demo in a folder it made) removes them; else exit in one line.
    The final model stays: this run's replaces it at the end."""
    found = earlier_run(output_dir)
    if found and not may_clear:
        resume = "continue it with --resume=latest, " if found.startswith("checkpoints") else ""
        mine = " (the demo clears only a folder it made)" if demo else ""
        sys.exit(
            f"error: {output_dir!r} holds {found}{mine}: {resume}overwrite it with --overwrite_output_dir=true, "
            "or start this one in another --output_dir"
        )
    for name in [*LOG_FILES, *(f"checkpoint_{step}" for step in find_checkpoints(output_dir))]:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def lock_refusal(output_dir, take_over, take_over_dead=False):
    """Create output_dir/train.lock exclusively (O_CREAT | O_EXCL, mode 0644) with this process's PID, host and
    start time and job (this_process). Returns '' when this run holds it, else the one line that refuses the run.
    A lock whose process no longer runs on this host (its PID gone, or now another process's: another start time),
    that names no process (empty or unreadable: a run killed or out of disk space as it wrote it), or that another
    host's process of this job wrote (a restart of the job: its processes have ended, a SLURM requeue or torchrun's
    restart may put rank 0 on another node) is a dead holder's: taken over with --take_over_lock, or by
    take_over_dead (a --resume). One of another host of another job, or of none (whose process this one cannot
    see), only with --take_over_lock; a lock of a live process never is. A lock that cannot be written (a full
    disk) is removed and its OSError raised."""
    path, host = os.path.join(output_dir, LOCK_FILE), socket.gethostname()
    for attempt in range(2):  # the second: after taking over a stale lock
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder, dead = lock_holder(path), True
            if holder is None:
                gone = "that names no run (empty: one killed while starting?)"
            elif holder["host"] != host:
                job = holder.get("job")
                dead = job is not None and job == job_id()
                gone = f"of PID {holder['pid']} on host {holder['host']}, another machine"
                if dead:
                    gone += f", of this job ({job}), which restarted"
                else:
                    gone += (f", of another job ({job})" if job else "") + ": if that run has ended"
            elif not process_runs(holder["pid"], holder.get("start")):
                gone = f"of PID {holder['pid']} on host {host}, which no longer runs (killed?)"
            else:
                return (
                    f"error: output_dir {output_dir!r} is in use by another run (PID {holder['pid']} on host {host}): "
                    "wait for it to end, or choose another --output_dir"
                )
            if not (take_over or (dead and take_over_dead)) or attempt:
                return f"error: output_dir {output_dir!r} has the lock {gone}: take it over with --take_over_lock"
            print(f"taking over {path}, the lock {gone}")
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        write_lock(descriptor, path)
        return ""


def write_lock(descriptor, path):
    """This process's record (this_process) into the lock just created, in one write; a write that fails (a full
    disk) removes the lock, so that no empty one stays behind."""
    record = json.dumps(this_process()).encode()
    try:
        written = os.write(descriptor, record)
        if written != len(record):
            raise OSError(errno.ENOSPC, f"{written} of {len(record)} bytes written")
    except BaseException:  # a full disk; Ctrl-C or SIGTERM in between (launch: Interrupted)
        os.remove(path)
        raise
    finally:
        os.close(descriptor)


def this_process():
    """What the lock records of this process: PID, host, start time (process_start) and job (job_id)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid()), "job": job_id()}


def job_id():
    """The job this process belongs to, as "VARIABLE=value" of the first of JOB_VARIABLES set; None outside one."""
    found = [(name, os.environ.get(name)) for name in JOB_VARIABLES if os.environ.get(name) not in (None, "", "none")]
    return f"{found[0][0]}={found[0][1]}" if found else None


def lock_holder(path):
    """{"pid", "host"[, "start", "job"]} of a lock file; None when it names none (empty, or a run killed
    mid-write)."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
        return holder if isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def process_start(pid):
    """When a process started, in clock ticks after boot (field 22 of /proc/PID/stat): with its PID, it names one
    process, since a PID is reused only after its process ended. None where /proc is not (macOS)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # after the name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def process_runs(pid, start=None):
    """Whether the process that wrote a lock still runs: its PID exists and, where the lock recorded one, with
    the same start time (else the PID belongs to another process now)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return start is None or process_start(pid) in (None, start)


@contextlib.contextmanager
def hold_output_dir(output_dir, take_over=False, resuming=False):
    """This run holds output_dir (lock_refusal) until the block ends, however it ends: normally, by an error,
    by Ctrl-C, SIGTERM or sys.exit; then the folders it made for the run go again if they are empty (a refused
    run leaves nothing behind). Refused: exit in one line naming the holder. resuming: a dead holder's lock
    (lock_refusal) is taken over with a notice. Once held, the checkpoint writes a killed holder cut short are
    finished (complete_interrupted_saves), so that the checkpoint a resume then chooses is the newest complete
    one. Under torchrun rank 0 alone holds it, for the job."""
    made = missing_folders(output_dir)
    try:
        os.makedirs(output_dir, exist_ok=True)
        refusal = lock_refusal(output_dir, take_over, take_over_dead=resuming)
    except BaseException as error:  # a full disk, a read-only folder; Ctrl-C or SIGTERM (launch: Interrupted)
        remove_if_empty(made)
        if not isinstance(error, OSError):
            raise
        fix = "free space there, or choose" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "choose"
        sys.exit(
            f"error: cannot write to output_dir {output_dir!r} ({error.strerror}); nothing was written: {fix} "
            "another --output_dir"
        )
    if refusal:
        remove_if_empty(made)
        sys.exit(refusal)
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        complete_interrupted_saves(output_dir)
        yield
    finally:
        if lock_holder(path) == this_process():  # still ours
            os.remove(path)
        remove_if_empty(made)


def missing_folders(path):
    """The folders that os.makedirs(path) would make, deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_if_empty(folders):
    """Remove each folder, deepest first, while it is empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (or gone): it and those above it stay
            return


def unshared_folder(world, output_dir):
    """'' when every rank of the run (world: its distributed.World) sees in output_dir the lock that rank 0 holds
    there, else the line that refuses the run before training: rank 0 alone writes the logs, checkpoints and the
    model, and every rank reads the checkpoint it resumes, so the nodes must share the folder. Collective."""
    if world.size == 1:
        return ""
    holder = world.from_rank_0(this_process() if world.is_main else None)
    seen = world.gather((lock_holder(os.path.join(output_dir, LOCK_FILE)) == holder, socket.gethostname()))
    blind = sorted({host for sees, host in seen if not sees})
    if not blind:
        return ""
    return (
        f"error: output_dir {output_dir!r} is not shared between the nodes: host {', '.join(blind)} does not see "
        f"the {LOCK_FILE} that rank 0 holds there on host {holder['host']}; rank 0 alone writes the checkpoints and "
        "every rank reads the one it resumes: put output_dir on a filesystem every node mounts at the same path"
    )
