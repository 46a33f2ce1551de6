"""Run by tests/test_crash_consistency.py: kills `python train.py`'s checkpoint writer with SIGKILL at each of its
file operations, in a real process each time.

    checkpoint_killer.py JOBS_JSON

JOBS_JSON: a list of {"folder", "step", "argv", "rewrite"}. For each job this process (which has imported train, and
so torch, once) first runs train.main(argv) on a scratch copy of the folder with every file operation of the
save_checkpoint of `step` counted (os.fsync, os.rename, os.replace, os.remove, shutil.rmtree: the writer's own
and those of the libraries it calls), then, for k = 1 .. that count, on a copy folder.k: a forked child that
runs the same command and kills itself with SIGKILL just before its k-th operation. "rewrite": the run stops at
once, before its next step, as a SIGTERM there makes it: it writes again the checkpoint it resumed. Prints a JSON
list: per job, the operations counted ([name, path]) and the signal that ended each child k (its folder: folder.k).
"""

import json
import os
import shutil
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from dapo_utils import checkpoints  # noqa: E402

COUNTED = ((os, "fsync"), (os, "rename"), (os, "replace"), (os, "remove"), (shutil, "rmtree"))


def recorded(name, operation, record):
    """operation (one of COUNTED) that first calls record([name, the path it acts on])."""

    def call(target, *args, **kwargs):
        record([name, os.readlink(f"/proc/self/fd/{target}") if name == "fsync" else os.fspath(target)])
        return operation(target, *args, **kwargs)

    return call


def killed_at(kill_at, step, operations):
    """Count the file operations of the save_checkpoint of `step` into operations; SIGKILL before the kill_at-th."""
    active, save = [False], checkpoints.save_checkpoint

    def count(operation):
        if active[0]:
            operations.append(operation)
            if len(operations) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def saving(trainer, *args, **kwargs):
        active[0] = trainer.state.update_steps == step
        try:
            return save(trainer, *args, **kwargs)
        finally:
            active[0] = False

    for module, name in COUNTED:
        setattr(module, name, recorded(name, getattr(module, name), count))
    checkpoints.save_checkpoint = saving


def stop_at_once(trainer):
    """What a SIGTERM before the resumed run's next step does: the checkpoint of where it stands, then the stop."""
    trainer.stop_requested = True
    checkpoints.stop_if_requested(trainer, {})


def run(job, kill_at, folder, operations):
    """train.main(job's argv) with --output_dir=folder, killed before operation kill_at (0: never)."""
    killed_at(kill_at, job["step"], operations)
    if job["rewrite"]:
        train.DapoTrainer.train = stop_at_once
    try:
        train.main([*job["argv"], f"--output_dir={folder}"])
    except SystemExit as stop:  # 130: the rewrite's stop
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def in_child(job, kill_at, folder):
    """run() in a forked child, on a fresh copy of the job's folder: (the signal that ended it or 0, the operations
    it counted, which it writes to folder.json if it lives to the end)."""
    shutil.copytree(job["folder"], folder)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # this process's stdout carries the JSON
        operations = []
        code = run(job, kill_at, folder, operations)
        with open(folder + ".json", "w", encoding="utf-8") as f:
            json.dump(operations, f)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), None
    with open(folder + ".json", encoding="utf-8") as f:
        return 0, json.load(f)


def main():
    results = []
    for job in json.loads(sys.argv[1]):  # this process never runs torch itself, so that it may fork
        _, operations = in_child(job, 0, job["folder"] + ".count")
        children = [in_child(job, k, f"{job['folder']}.{k}")[0] for k in range(1, len(operations) + 1)]
        results.append({"operations": operations, "signals": children})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
