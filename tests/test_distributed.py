"""Data-parallel training (distributed.py) with two CPU processes over gloo, launched by torch.distributed.run."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_utils.curves import read_jsonl
from train import DapoArguments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "dist_worker.py")
TIMEOUT = 1200  # s per launch: a hang fails the test, not CI (this test took 252 s for 4 launches, load 17)


def run(args, nproc=None, check=True):
    """python ARGS (one process), or torch.distributed.run with nproc processes."""
    launcher = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run"]
    if nproc is not None:
        launcher += [f"--nproc_per_node={nproc}", "--standalone"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(launcher + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done


def worker(scenario, world, out, nproc=None, **overrides):
    run([WORKER, scenario, *world, str(out), json.dumps(overrides)], nproc)
    ranks = range(nproc or 1)
    return [json.load(open(os.path.join(out, f"rank_{r}.json"))) for r in ranks], os.path.join(out, "result.pt")


@pytest.fixture(scope="module")
def one_process_step(world, tmp_path_factory):
    """The equivalence scenario's one-process run (batch_size 2): (report, result.pt path)."""
    single, single_result = worker("equivalence", world, tmp_path_factory.mktemp("one"), batch_size=2)
    return single[0], single_result


def test_two_processes_take_the_one_process_step(world, tmp_path, one_process_step):
    """batch_size b on each of 2 ranks == batch_size 2b on one process, the same groups, for every loss_agg_mode."""
    single, single_result = one_process_step
    double, double_result = worker("equivalence", world, tmp_path / "two", nproc=2, batch_size=1)
    assert double[0] == double[1] == single  # the step's token count, gathered from both ranks
    one, two = torch.load(single_result), torch.load(double_result)
    for mode in one:
        for name, value in one[mode].items():
            torch.testing.assert_close(two[mode][name], value, atol=1e-5, rtol=0, msg=f"{mode}: {name}")
    # lr 1 SGD: the step moved the weights, and differently per mode (a mode ignored would show)
    moved = {mode: (one[mode]["lm_head.weight"] - one["initial"]["lm_head.weight"]).abs().max() for mode in one}
    assert all(moved[mode] > 1e-3 for mode in ("seed", "token-mean", "seq-mean-token-mean")), moved
    weights = [one[mode]["lm_head.weight"] for mode in ("seed", "token-mean", "seq-mean-token-mean")]
    assert not (torch.equal(weights[0], weights[1]) or torch.equal(weights[1], weights[2]))


def test_a_rank_without_groups_still_steps_with_the_others(world, tmp_path):
    reports, _ = worker("starved_rank", world, tmp_path, nproc=2)
    zero, one = reports
    assert zero["steps"] == one["steps"] == 3 and zero["history"] == one["history"] == [1, 2, 3]
    # rank 0 alone fills each step (2 micro-batches x 1 group x 2 ranks = 4 groups: 4 rounds), rank 1 skips all
    assert zero["num_gen_batches"] == one["num_gen_batches"] == [4, 4, 4]
    assert zero["skipped_groups"] == one["skipped_groups"] == 12  # counted over both ranks
    # resumed from checkpoint_3 for one more step: 12 + 4, on both ranks (not each rank's 12 summed again)
    assert zero["skipped_after_resume"] == one["skipped_after_resume"] == 16
    assert (
        zero["rounds"] == one["rounds"] == 3
        and "3 sampling rounds" in zero["error"]
        and "3 sampling rounds" in one["error"]
    )
    # SIGTERM reached rank 1 alone in step 2: both ranks stopped after step 2, with its checkpoint
    assert zero["sigterm_stopped_at"] == one["sigterm_stopped_at"] == 2
    assert zero["sigterm_saved"] == one["sigterm_saved"] == ["checkpoint_2"]


def train_py(world, out, *extra, nproc=2, check=True):
    model_dir, data_dir = world
    settings = dict(model_path=model_dir, data_path=data_dir, output_dir=out, device="cpu", max_generate_length=12)
    settings |= dict(eval_samples=4, eval_batch_size=4, num_generations=4, lr=1e-3, filter_metric="none")
    settings |= dict(eval_steps=10, save_steps=10)
    return run(["train.py", *(f"--{k}={v}" for k, v in settings.items()), *extra], nproc, check)


def test_train_py_under_torchrun_logs_once_and_resumes(world, tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    with open(os.path.join(out, "train.lock"), "w") as f:  # a live run holds the folder: this test's process
        json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
    refused = train_py(world, out, "--max_steps=20", check=False)
    holder = f"is in use by another run (PID {os.getpid()} on host {socket.gethostname()})"
    assert refused.returncode != 0 and holder in refused.stderr  # rank 0 holds the folder for the job
    os.remove(os.path.join(out, "train.lock"))
    train_py(world, out, "--max_steps=20")
    assert not os.path.exists(os.path.join(out, "train.lock"))  # let go at the end
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all(r["num_gen_batches"] == 2 for r in records)  # 4 groups a step: 2 rounds of 1 prompt on 2 ranks
    with open(os.path.join(out, "training_losses.txt")) as f:
        assert len(f.read().splitlines()) == 20 * 4  # 2 micro-steps on each of 2 ranks
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        assert [line.split(",")[0] for line in f.read().splitlines()] == ["0", "10", "20"]
    assert len(read_jsonl(os.path.join(out, "samples.jsonl"))) == 3 * 4
    assert os.path.exists(os.path.join(out, "curves.png")) and os.path.exists(os.path.join(out, "model.safetensors"))
    state = torch.load(os.path.join(out, "checkpoint_20", "trainer_state.pt"), weights_only=True)
    assert state["loop"]["world_size"] == 2 and len(state["loop"]["ranks"]) == 2

    # One process cannot continue a two-process run; it says how to.
    refused = run(["train.py", "--resume=latest", f"--output_dir={out}", "--max_steps=22"], check=False)
    assert refused.returncode != 0 and "torchrun --nproc_per_node=2" in refused.stderr

    train_py(world, out, "--resume=latest", "--max_steps=22")
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 23))


# ---- --fsdp: torch's fully_shard (FSDP2) over the same two gloo processes ----
def test_fsdp_takes_the_one_process_step(world, tmp_path, one_process_step):
    """Sharded parameters, gradients reduce-scattered as a sum: the one-process step (token-mean), and the same
    gradient norm from clip_grad_norm_ over the shards."""
    single, single_result = one_process_step
    modes = ["token-mean"]
    sharded, sharded_result = worker("equivalence", world, tmp_path, nproc=2, batch_size=1, fsdp=True, modes=modes)
    assert sharded[0]["token-mean"] == sharded[1]["token-mean"] == single["token-mean"]
    one, two = torch.load(single_result), torch.load(sharded_result)
    assert two["token-mean"].keys() == one["token-mean"].keys()  # gathered whole, every tensor
    for name, value in one["token-mean"].items():
        torch.testing.assert_close(two["token-mean"][name], value, atol=1e-5, rtol=0, msg=name)
    assert (two["token-mean"]["lm_head.weight"] - two["initial"]["lm_head.weight"]).abs().max() > 1e-3


def test_fsdp_rank_without_groups_and_uneven_generate_do_not_hang(world, tmp_path):
    """Rank 1 keeps no group: it runs placeholder micro-batches (forward, backward, and the reference model's
    and pi_old's forwards: beta > 0, steps_per_generation 2) while rank 0 trains; and generate with
    rank-dependent lengths inside World.unsharded. A hang would be a timeout."""
    settings = dict(fsdp=True, beta=0.04, steps_per_generation=2)
    zero, one = worker("starved_rank", world, tmp_path, nproc=2, **settings)[0]
    assert zero["steps"] == one["steps"] == 3 and zero["history"] == one["history"] == [1, 2, 3]
    assert (zero["generated"], one["generated"]) == (3 + 3, 3 + 8)
    with open(os.path.join(tmp_path, "training_losses.txt")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 3 * 2 * 4  # 8 micro-batches a rollout, 4 a step, on each rank: rank 1's weigh 0
    assert sum(line.endswith(",0.00000000") for line in lines) >= 3 * 4


def test_train_py_with_fsdp_saves_resumes_and_writes_a_loadable_model(world, tmp_path):
    """torchrun train.py --fsdp=true (beta > 0: the reference model is sharded too), with an evaluation whose 3
    problems split 2 / 1 over the ranks in batches of 1 (uneven generate calls), a checkpoint at step 2, a
    resume to step 4; the final model loads in one process."""
    out = str(tmp_path / "run")
    extra = ["--fsdp=true", "--beta=0.04", "--eval_samples=3", "--eval_batch_size=1", "--eval_steps=2"]
    done = train_py(world, out, *extra, "--max_steps=2", "--save_steps=2")
    # Both ranks end in distributed.end_of_run (os._exit, no interpreter shutdown): exit 0, rank 0's summary last.
    last_line = done.stdout.splitlines()[-1]
    assert last_line.startswith("held-out accuracy (strict / lenient)  step 0 ") and "->  step 2 " in last_line
    at_2 = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint_2")).state_dict()
    final_2 = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(at_2[k], final_2[k]) for k in at_2)
    state = torch.load(os.path.join(out, "checkpoint_2", "trainer_state.pt"), weights_only=True)
    assert sorted(state["optimizer"]["state"]) == list(range(len(state["optimizer"]["state"])))  # plain format
    assert state["optimizer"]["state"][0]["exp_avg"].shape == at_2["model.embed_tokens.weight"].shape  # whole

    train_py(world, out, *extra, "--resume=latest", "--max_steps=4", "--save_steps=2")
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        assert [line.split(",")[0] for line in f.read().splitlines()] == ["0", "2", "4"]
    final = AutoModelForCausalLM.from_pretrained(out).state_dict()  # one process, no FSDP
    assert any(not torch.equal(final[k], at_2[k]) for k in final)  # steps 3 and 4 trained


def test_end_of_run_leaves_a_group_of_one_to_the_usual_shutdown(tmp_path):
    """vLLM starts a process group of 1 in the trainer's process (and transformers imports torch's FSDP): after
    main(), end_of_run returns and the interpreter shuts down as usual, atexit handlers included."""
    script = (
        "import atexit, torch.distributed as dist, torch.distributed.fsdp\nfrom dapo_utils import distributed\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "atexit.register(print, 'shutdown ran')\n"
        "distributed.end_of_run()\n"
        "print('returned')\n"
    )
    assert run(["-c", script]).stdout == "returned\nshutdown ran\n"


def test_fsdp_refuses_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node=N train.py --fsdp=true"):
        DapoArguments(fsdp=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    DapoArguments(fsdp=True)  # under torchrun: fine
    DapoArguments(fsdp=True, use_vllm=True, device="cpu")  # an engine per rank (tests/test_vllm_trainer.py runs it)
