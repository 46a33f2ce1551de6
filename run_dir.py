"""The output folder a run writes to: it holds the folder for the whole run (hold_output_dir, a lock file with
its PID and host: lock_refusal, lock_holder, process_runs), and a fresh run claims it (claim_output_dir: an
earlier run's logs and checkpoints cleared with --overwrite_output_dir=true, else refused; earlier_run says
what is there). Used by cli.py (every run) and tiny_world.py (the demo's own folder)."""

import contextlib
import json
import os
import shutil
import socket
import sys

from checkpoints import LOG_FILES, find_checkpoints

LOCK_FILE = "train.lock"  # in output_dir while a run writes there: {"pid": ..., "host": ...}
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


def lock_refusal(output_dir, take_over):
    """Create output_dir/train.lock exclusively (O_CREAT | O_EXCL) with this process's PID and host.
    Returns '' when this run holds it, else the one line that refuses the run. A lock whose process no longer
    runs (same host), or one of another host (whose process this one cannot see), is taken over with
    --take_over_lock; a lock of a live process never is."""
    path, host = os.path.join(output_dir, LOCK_FILE), socket.gethostname()
    for attempt in range(2):  # the second: after taking over a stale lock
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock_holder(path)
            if holder is None:
                gone = "names no run (one killed while starting?)"
            elif holder["host"] != host:
                gone = f"of PID {holder['pid']} on host {holder['host']}, another machine: if that run has ended"
            elif not process_runs(holder["pid"]):
                gone = f"of PID {holder['pid']} on host {host}, which no longer runs (killed?)"
            else:
                return (
                    f"error: output_dir {output_dir!r} is in use by another run (PID {holder['pid']} on host {host}): "
                    "wait for it to end, or choose another --output_dir"
                )
            if not take_over or attempt:
                return f"error: output_dir {output_dir!r} has the lock {gone}: take it over with --take_over_lock"
            print(f"taking over {path}, the lock {gone}")
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with os.fdopen(descriptor, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": host}, f)
        return ""


def lock_holder(path):
    """{"pid", "host"} of a lock file; None when it names none (empty, or a run killed mid-write)."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
        return holder if isinstance(holder.get("pid"), int) and isinstance(holder.get("host"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def process_runs(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def hold_output_dir(output_dir, take_over=False, enabled=True):
    """This run holds output_dir (lock_refusal) until the block ends, however it ends: normally, by an error,
    by Ctrl-C or sys.exit. Refused: exit in one line naming the holder. enabled=False holds nothing (torchrun's
    ranks but rank 0, which holds the folder for the job)."""
    if not enabled:
        yield
        return
    try:
        os.makedirs(output_dir, exist_ok=True)
        refusal = lock_refusal(output_dir, take_over)
    except OSError as error:
        sys.exit(f"error: cannot write to output_dir {output_dir!r} ({error.strerror}): choose another --output_dir")
    if refusal:
        sys.exit(refusal)
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        yield
    finally:
        if lock_holder(path) == {"pid": os.getpid(), "host": socket.gethostname()}:  # still ours
            os.remove(path)
