"""train.py beyond one machine (docs/multi-gpu.md), on CPU with gloo: two "nodes" (two torchrun launches on this
host, one c10d rendezvous) against one node with as many processes, DDP and FSDP; an output folder the nodes do not
share, refused before training; --resume=auto on an empty, a checkpointed and a foreign folder; torchrun
--max-restarts after a worker's SIGKILL and a worker's SIGTERM; the SLURM script of docs/multi-gpu.md through a
preemption. Every run but the refused ones ends as one uninterrupted run on one node does (the module's fixture).
Launches write to log files (two nodes filling a pipe each would wait on each other) and take free ports picked
at run time (other test sessions may run torchrun beside this one)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_utils import options
from dapo_utils.checkpoints import find_checkpoint, find_checkpoints
from dapo_utils.curves import read_jsonl
from train import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 1200  # s per launch: a hang fails the test, not CI (sized for a CPU 5x slower than the shared 2-core one)
# 8 steps of 4 groups (2 ranks x 2 micro-batches x 1 prompt), the seed's filter: refills and groups sent between ranks
RUN = dict(device="cpu", max_generate_length=12, eval_samples=4, eval_batch_size=4, num_generations=4, lr=1e-3)
RUN |= dict(eval_steps=3, save_steps=2, max_steps=8)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_args(world, out=None, **changes):
    model_dir, data_dir = world
    settings = dict(model_path=model_dir, data_path=data_dir, **RUN) | ({"output_dir": out} if out else {})
    return [f"--{key}={value}" for key, value in (settings | changes).items()]


def torchrun(*options):
    return [sys.executable, "-m", "torch.distributed.run", *options]


def start(command, log, env=None):
    """command in the repository, its output (stdout and stderr) to the file log."""
    launched = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    launched |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"} | (env or {})
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=REPO, env=launched, stdout=output, stderr=subprocess.STDOUT)


def finish(process, log):
    """(exit status, output) once it ends."""
    process.wait(timeout=TIMEOUT)
    with open(log) as f:
        return process.returncode, f.read()


def on_two_nodes(folder, args_per_node):
    """Two torchrun launches, --node_rank 0 and 1, one process each, meeting at one c10d rendezvous on this host:
    [(exit status, output)] of each."""
    endpoint = f"--rdzv_endpoint=127.0.0.1:{free_port()}"
    nodes = ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", endpoint, "--rdzv_id=dapo")
    logs = [folder / f"node_{rank}.log" for rank in (0, 1)]
    launched = [start(torchrun(*nodes, f"--node_rank={r}", "train.py", *args_per_node[r]), logs[r]) for r in (0, 1)]
    return [finish(process, log) for process, log in zip(launched, logs)]


def traceback_of_ours(output):
    """Whether output holds a traceback through train.py or dapo_utils (torchrun prints its own on any failure)."""
    return f'File "{REPO}/train.py"' in output or f'File "{REPO}/dapo_utils/' in output


def children(parent, script):
    """{RANK (0 when unset): pid} of the processes running `script` whose parent is `parent`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode().split("\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split("=", 1) for e in f.read().decode().split("\0") if "=" in e)
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
        if ppid == parent and script in command:
            found[int(env.get("RANK", "0"))] = int(pid)
    return found


def wait_for(condition, process, log):
    """condition()'s first true value, checked every 20 ms while process runs."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            raise AssertionError(
                f"ended (exit {process.returncode}) before the moment came:\n{finish(process, log)[1][-4000:]}"
            )
        time.sleep(0.02)
    raise AssertionError("timed out")


TRAINED = ("loss", "grad_norm", "num_tokens", "learning_rate", "skipped_groups", "entropy")  # what a step trained


def assert_same_run(out, expected, tolerance=0.0, keys=None):
    """out's metrics.jsonl (each record's keys: all but timings) and final weights are expected's (another folder's),
    within tolerance. A run stopped between two sampling rounds of a step logs that step's rounds after its resume
    alone (docs/checkpoints.md): keys=TRAINED compares what the steps trained."""
    drop = (
        "time/",
        "perf/throughput",
        "perf/mfu",
        "perf/sampling_",
        "sampled_tokens_per_second",
        "train_tokens_per_second",
    )
    records, reference = (read_jsonl(os.path.join(folder, "metrics.jsonl")) for folder in (out, expected))
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, RUN["max_steps"] + 1))
    for record, wanted in zip(records, reference):
        wanted = {key: value for key, value in wanted.items() if not key.startswith(drop) and key in (keys or wanted)}
        assert [key for key in wanted if record[key] is None] == [key for key in wanted if wanted[key] is None]
        wanted = {key: value for key, value in wanted.items() if value is not None}  # approx compares numbers
        assert {key: record[key] for key in wanted} == pytest.approx(wanted, rel=tolerance, abs=tolerance)
    final, whole = (AutoModelForCausalLM.from_pretrained(folder).state_dict() for folder in (out, expected))
    for name, value in whole.items():
        torch.testing.assert_close(final[name], value, atol=max(tolerance, 1e-7), rtol=0, msg=name)


@pytest.fixture(scope="module")
def one_node(world, tmp_path_factory):
    """One node, 2 processes, uninterrupted: its output folder and output."""
    folder = tmp_path_factory.mktemp("one_node")
    out, log = folder / "run", folder / "log"
    status, output = finish(
        start(torchrun("--standalone", "--nproc_per_node=2", "train.py", *train_args(world, out)), log), log
    )
    assert status == 0, output[-4000:]
    return out, output


def test_one_node_writes_once_holds_the_folder_and_says_how_to_resume_with_one_process(world, tmp_path, one_node):
    out, output = one_node
    assert not (out / "train.lock").exists()  # let go at the end
    with open(out / "training_losses.txt") as f:
        assert len(f.read().splitlines()) == 8 * 4  # 2 micro-steps on each of 2 ranks, written once
    with open(out / "accuracy_losses.txt") as f:
        assert [line.split(",")[0] for line in f.read().splitlines()] == ["0", "3", "6"]
    assert len(read_jsonl(out / "samples.jsonl")) == 3 * 4
    assert (out / "curves.png").exists() and (out / "model.safetensors").exists()
    assert output.count("held-out accuracy (strict / lenient)") == 1  # rank 0's summary alone
    state = torch.load(out / "checkpoint_8" / "trainer_state.pt", weights_only=True)
    assert state["loop"]["world_size"] == 2 and len(state["loop"]["ranks"]) == 2
    # A live run holds a folder: both ranks stop before anything loads, rank 0 alone says why.
    held = tmp_path / "held"
    held.mkdir()
    (held / "train.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    command = torchrun("--standalone", "--nproc_per_node=2", "train.py", *train_args(world, held))
    status, refused = finish(start(command, tmp_path / "held.log"), tmp_path / "held.log")
    holder = f"is in use by another run (PID {os.getpid()} on host {socket.gethostname()})"
    assert status != 0 and refused.count(holder) == 1 and not traceback_of_ours(refused)
    # One process resumes a 2-process checkpoint only with the same step: 2 x 2 micro-batches, said in one line.
    command = [sys.executable, "train.py", "--resume=latest", f"--output_dir={out}", "--max_steps=9"]
    status, refused = finish(start(command, tmp_path / "one.log"), tmp_path / "one.log")
    assert (
        status != 0
        and (
            f"error: cannot resume {out}/checkpoint_8: its steps were 2 micro-batches on each of 2 process(es), this "
            f"run's 2 on each of 1: resume with --gradient_accumulation_steps=4 or with {options.run_command(2)} "
            "--gradient_accumulation_steps=2"
        )
        in refused
    )


def test_the_resume_command_names_torchrun_per_node_as_torchrun_started_the_process(monkeypatch):
    """run_command reads LOCAL_WORLD_SIZE as torchrun set it at the start: vLLM's CPU platform sets it to its own
    tensor-parallel size (1) in the trainer's process later, which made a 2-process run's stop line read as if it
    ran on 2 nodes. The launcher is torch's module run by this interpreter: no torchrun on PATH needed."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # what vLLM leaves behind
    python = options.python_command().split(" ")[0]
    assert options.run_command(2) == f"{python} -m torch.distributed.run --nproc_per_node=2 train.py"
    monkeypatch.setattr(options, "PER_NODE", "1")  # torchrun's own, on 2 nodes of 1 process
    assert options.run_command(2) == "the same torchrun command on each of the 2 nodes with"
    assert options.run_command(1) == f"{python} train.py"
    assert options.run_command(1, fsdp=True) == f"{python} -m torch.distributed.run --nproc_per_node=1 train.py"


def test_two_nodes_take_one_nodes_steps_and_refuse_an_output_folder_they_do_not_share(world, tmp_path, one_node):
    """2 nodes x 1 process == 1 node x 2 processes: the same metrics and weights, DDP (exactly) and FSDP (within
    1e-5). Each node with an output_dir of its own (not shared): refused on both before training."""
    expected, _ = one_node
    unshared = on_two_nodes(tmp_path, [train_args(world, tmp_path / f"node{rank}") for rank in (0, 1)])
    outputs = [output for _, output in unshared]
    assert all(status != 0 for status, _ in unshared)
    line = [line for output in outputs for line in output.splitlines() if "is not shared between the nodes" in line]
    assert len(line) == 1 and line[0].startswith("error: output_dir '") and not traceback_of_ours("".join(outputs))
    assert "put output_dir on a filesystem every node mounts at the same path" in line[0]
    assert not any(find_checkpoints(tmp_path / f"node{r}") or (tmp_path / f"node{r}" / "metrics.jsonl").exists()
                   for r in (0, 1))  # fmt: skip
    for name, extra, tolerance in (("ddp", {}, 0.0), ("fsdp", {"fsdp": "true"}, 1e-5)):
        out = tmp_path / name
        nodes = on_two_nodes(tmp_path, [train_args(world, out, **extra)] * 2)
        assert all(status == 0 for status, _ in nodes), "\n".join(output[-3000:] for _, output in nodes)
        assert sum(output.count("held-out accuracy (strict / lenient)") for _, output in nodes) == 1  # rank 0's
        with open(out / "training_losses.txt") as f:
            assert len(f.read().splitlines()) == 8 * 4
        assert_same_run(out, expected, tolerance)
        assert not (out / "train.lock").exists()


def test_resume_auto_starts_resumes_the_newest_intact_checkpoint_and_refuses_a_foreign_folder(world, tmp_path, capsys):
    out = tmp_path / "run"
    command = [*train_args(world, out, max_steps=2, eval_steps=100), "--resume=auto"]
    fresh = main(command)  # no folder yet: a fresh run
    assert not fresh.resumed and fresh.update_steps == 2 and find_checkpoints(out) == [2]
    host = socket.gethostname()
    (out / "train.lock").write_text(json.dumps({"pid": os.getpid(), "host": host, "start": 1}))  # a killed run's
    resumed = main([*command, "--max_steps=3"])  # the same command, later (here: one more step)
    assert resumed.resumed and resumed.update_steps == 3
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert f"taking over {out}/train.lock, the lock of PID {os.getpid()} on host {host}, which no longer runs" in (
        capsys.readouterr().out
    )
    # The newest checkpoint does not read back: the newest intact one, said in a line.
    shutil.copytree(out / "checkpoint_2", out / "checkpoint_4")
    with open(out / "checkpoint_4" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert find_checkpoint("auto", str(out)) == str(out / "checkpoint_2")
    printed = capsys.readouterr().out
    assert printed.startswith(f"{out}/checkpoint_4/model.safetensors is damaged (") and printed.endswith(
        f": resuming {out}/checkpoint_2, the newest intact checkpoint\n"
    )
    # Another run's logs and no checkpoint: refused as a fresh run is, nothing touched.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit) as refused:
        main([*train_args(world, foreign, max_steps=1), "--resume=auto"])
    assert refused.value.code == (
        f"error: {str(foreign)!r} holds the logs and model of an earlier run (metrics.jsonl): overwrite it with "
        "--overwrite_output_dir=true, or start this one in another --output_dir"
    )
    assert (foreign / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (foreign / "train.lock").exists()


def test_torchrun_restarts_after_a_workers_sigkill_and_sigterm_and_ends_as_the_uninterrupted_run(
    world, tmp_path, one_node
):
    """torchrun --max-restarts=2 ... --resume=auto: rank 0 (the lock's holder) killed with SIGKILL once checkpoint_2
    exists; the group restarts, takes the dead lock over and resumes the newest checkpoint; once it has written a
    newer one, rank 1 gets SIGTERM: every rank stops after the step with a checkpoint; the group restarts again and
    ends with the uninterrupted run's metrics and weights."""
    expected, _ = one_node
    out, log = tmp_path / "run", tmp_path / "log"
    command = torchrun("--standalone", "--nproc_per_node=2", "--max-restarts=2", "train.py", "--resume=auto")
    process = start([*command, *train_args(world, out)], log)
    first = wait_for(lambda: find_checkpoints(out) and len(children(process.pid, "train.py")) == 2 and
                     children(process.pid, "train.py"), process, log)  # fmt: skip
    os.kill(first[0], signal.SIGKILL)
    killed_at = max(find_checkpoints(out))  # rank 0 alone writes them: none comes after its end

    def restarted_past_its_checkpoint():
        workers = children(process.pid, "train.py")
        fresh = len(workers) == 2 and not set(workers.values()) & set(first.values())
        return fresh and max(find_checkpoints(out)) > killed_at and workers

    second = wait_for(restarted_past_its_checkpoint, process, log)
    os.kill(second[1], signal.SIGTERM)
    status, output = finish(process, log)
    assert status == 0, output[-4000:]
    assert f"taking over {out}/train.lock, the lock of PID {first[0]} on host {socket.gethostname()}" in output
    assert "SIGTERM: stopping with a checkpoint of the last finished step" in output
    assert output.count("stopped; continue with:") == 1  # rank 0's line for the job
    stopped = re.search(
        r"stopped; continue with: \S+ -m torch.distributed.run --nproc_per_node=2 \S+ --resume=(\S+)", output
    )
    assert stopped and os.path.basename(stopped.group(1)) in {f"checkpoint_{s}" for s in find_checkpoints(out)}
    assert_same_run(out, expected, keys=TRAINED)


def slurm_script():
    """The SLURM script of docs/multi-gpu.md: its ```bash block with #SBATCH lines."""
    with open(os.path.join(REPO, "docs", "multi-gpu.md"), encoding="utf-8") as f:
        blocks = re.findall(r"^```bash\n(.*?)^```", f.read(), flags=re.S | re.M)
    (script,) = [block for block in blocks if "#SBATCH" in block]
    return script


def test_the_slurm_script_survives_a_preemption_and_ends_as_the_uninterrupted_run(world, tmp_path, one_node):
    """docs/multi-gpu.md's script, run by bash with `srun` and `scontrol` standing in (one node of 2 processes):
    SIGTERM mid-run to the shell, torchrun and each worker, as SLURM signals the job's processes (so each worker
    also gets torchrun's forwarded one); the workers stop after the step with a checkpoint, the shell waits. The identical command
    again (the requeued job) resumes it and ends with the uninterrupted run's metrics and weights, on other nodes:
    through the lock a SIGKILL past the grace leaves on the first job's node, which is the same job's."""
    expected, _ = one_node
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    (stand_ins / "srun").write_text('#!/bin/sh\nexec "$@"\n')  # one task on one node: the command itself
    (stand_ins / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # `show hostnames`: the first node
    for name in ("srun", "scontrol"):
        (stand_ins / name).chmod(0o755)
    (tmp_path / "dapo.sbatch").write_text(slurm_script())
    out = tmp_path / "run"
    env = dict(SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", SLURM_JOB_ID="4242", GPUS_PER_NODE="2")
    env |= dict(RDZV_PORT=str(free_port()), OUTPUT_DIR=str(out))
    env["PATH"] = os.pathsep.join([str(stand_ins), os.path.dirname(sys.executable), os.environ["PATH"]])
    command = ["bash", str(tmp_path / "dapo.sbatch"), *train_args(world)]
    job = start(command, tmp_path / "first.log", env)
    first = tmp_path / "first.log"
    agent = wait_for(lambda: find_checkpoints(out) and children(job.pid, "--rdzv_backend=c10d"), job, first)[0]
    workers = wait_for(lambda: len(children(agent, "train.py")) == 2 and children(agent, "train.py"), job, first)
    for pid in [job.pid, agent, *workers.values()]:  # the batch shell, torchrun, each worker
        os.kill(pid, signal.SIGTERM)
    status, output = finish(job, first)
    assert (
        status != 0 and output.count("SIGTERM: stopping with a checkpoint of the last finished step") == 2
    )  # a rank each
    assert (
        len(
            re.findall(r"stopped; continue with: \S+ -m torch.distributed.run --nproc_per_node=2 \S+ --resume=", output)
        )
        == 1
    )
    stopped_at = max(find_checkpoints(out))
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, stopped_at + 1))
    assert stopped_at < RUN["max_steps"] and not (out / "train.lock").exists()
    (out / "train.lock").write_text(json.dumps({"pid": 1, "host": "node1", "start": 1, "job": "SLURM_JOB_ID=4242"}))
    status, output = finish(start(command, tmp_path / "again.log", env), tmp_path / "again.log")  # requeued
    assert status == 0, output[-4000:]
    assert (
        "the lock of PID 1 on host node1, another machine, of this job (SLURM_JOB_ID=4242), which restarted" in output
    )
    assert_same_run(out, expected, keys=TRAINED)
