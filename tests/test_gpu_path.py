"""The CUDA path, on a CPU (issue 42; docs/gpu.md has the table): what a GPU run would hit, each exercised here
where its mechanism can be, with a stand-in for the GPU where it cannot ("meta" for a device tensors must move to,
torch.cuda's functions replaced by recording ones, a fake vLLM engine that keeps vLLM 0.32's sleep-mode rules).
Reads from the device (item, tolist, int(tensor), ...) are counted with a TorchFunctionMode: on CUDA each waits
for the queued kernels."""

import datetime
import os
import subprocess
import sys
import weakref
from unittest import mock
from types import SimpleNamespace

import pytest
import safetensors
import torch
from torch.overrides import TorchFunctionMode

import train
from conftest import make_batch
from dapo_utils import distributed, vllm_sampler
from dapo_utils.checkpoints import TRAINER_STATE, resume, save_checkpoint
from dapo_utils import decoding
from dapo_utils.kernels import log_probs_from_hidden
from dapo_utils.lora import merged_weights
from dapo_utils.vllm_sampler import VllmSampler, policy_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts reads from a tensor's memory to Python made by code in `files` (the trainer's own, not transformers')."""

    def __init__(self, *files):
        super().__init__()
        self.files, self.count = files, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_code.co_filename
        self.count += getattr(func, "__name__", "") in HOST_READS and caller.endswith(self.files)
        return func(*args, **(kwargs or {}))


def checksum(weights):
    """A number that changes with any of the (name, tensor) weights."""
    return float(sum(tensor.double().sum() for _, tensor in weights))


def loop_tensors(state):
    return [t for item in [*state.buffer, *(state.rollout or [])] for t in vars(item).values() if torch.is_tensor(t)]


# ---------- resume: the loop state on the run's device ----------
def test_resume_moves_buffered_groups_and_the_unfinished_rollout_to_the_runs_device(make_trainer, tmp_path):
    """The trainer state is read into CPU memory (as --fsdp must: full optimizer states); the buffered groups and the
    half-done rollout then go to the run's device, where the next micro-batch meets the model's hidden states.
    "meta" stands in for "cuda": tensors move there as to a GPU. Before, they stayed where torch.load put them."""
    settings = dict(max_steps=1, save_steps=1, eval_steps=100, steps_per_generation=2, generation_batch_size=6)
    make_trainer(filter_metric="none", **settings).train()  # 6 groups sampled, 4 make the rollout, 2 wait
    resumed = make_trainer(filter_metric="none", **settings)
    resumed.args.device = "meta"
    resume(resumed, str(tmp_path / "output" / "checkpoint_1"))
    state = resumed.state
    assert len(state.buffer) == 2 and len(state.rollout) == 4 and state.updates_done == 1  # 1 of its 2 steps done
    assert len(loop_tensors(state)) > 20 and {t.device.type for t in loop_tensors(state)} == {"meta"}
    moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]  # on their parameters' device
    assert moments and {m.device.type for m in moments} == {"cpu"}


# ---------- checkpoints: the current GPU's RNG alone ----------
def test_checkpoints_save_and_restore_the_runs_gpu_rng_alone(make_trainer, monkeypatch):
    """get_rng_state_all saved every visible GPU's state, and set_rng_state_all with fewer visible GPUs raises
    IndexError; a checkpoint holds the run's GPU's state, and one written before (a list) gives that GPU's entry."""
    trainer = make_trainer(eval_steps=100)
    mine, restored = torch.arange(16, dtype=torch.uint8), []

    def every_gpu(*args):
        raise AssertionError("every visible GPU's RNG state")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": mine.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    trainer.args.device = "cuda"  # saving and resuming only: nothing runs on it
    checkpoint = save_checkpoint(trainer)
    path = os.path.join(checkpoint, TRAINER_STATE)
    assert torch.equal(torch.load(path, weights_only=True)["cuda_rng"], mine)
    resume(trainer, checkpoint)
    assert len(restored) == 1 and torch.equal(restored[0][0], mine) and restored[0][1] == "cuda"

    saved = torch.load(path, weights_only=True)  # as written before: 8 GPUs' states; resumed with one visible
    saved["cuda_rng"] = [torch.full((16,), gpu, dtype=torch.uint8) for gpu in range(8)]
    torch.save(saved, path)
    restored.clear()
    resume(trainer, checkpoint)
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.zeros(16, dtype=torch.uint8))


# ---------- the temperature divides float32 logits ----------
def test_temperature_divides_float32_logits_under_bf16_autocast():
    """Under bf16 autocast the output layer's logits are bf16; generate and vLLM divide them by T in float32.
    Qwen's 151,936 ids, logits up to ~29: the trainer's log-probs and their gradients against that float32
    reference; dividing in bf16 (before) moved the log-probs by 0.02 nats on average at T 0.7."""
    torch.manual_seed(0)
    V, H, K, T = 151936, 64, 128, 0.7
    hidden, weight = torch.randn(K, H, requires_grad=True), (0.6 * torch.randn(V, H)).requires_grad_()
    labels = torch.randint(V, (K,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, _ = log_probs_from_hidden(hidden[None], weight, labels[None], temperature=T)
    log_probs[0].sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float()  # the output layer's bf16 logits, then float32
    reference = (logits / T).log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    reference.sum().backward()
    assert logits.detach().abs().max() > 20
    assert (log_probs[0] - reference).abs().max() < 1e-4
    torch.testing.assert_close(ours[0], hidden.grad, rtol=0.02, atol=1e-3)
    torch.testing.assert_close(ours[1], weight.grad, rtol=0.02, atol=1e-4)
    divided_in_bf16 = (logits.bfloat16() / T).float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    assert (divided_in_bf16 - reference).abs().mean() > 0.01  # what the tolerance above tells apart


# ---------- sampling: CUDA graphs on CUDA, the decode loop elsewhere ----------
def test_cuda_samples_through_generate_over_a_static_cache():
    """On CUDA the default sampler is generate over a static KV cache (its decode step compiled with
    torch.compile(mode="reduce-overhead"): CUDA graphs), its prompts left-padded to a multiple of 64 columns so that
    few shapes are compiled; fsdp's gathered model and cuda_graphs=False decode in the loop, as the CPU does.
    tests/test_decoding.py checks that path's samples and distribution on the CPU."""
    assert decoding.sampler("cuda", True, False) is decoding.generate_with_graphs
    for device, graphs, fsdp in (("cuda", False, False), ("cuda", True, True), ("cpu", True, False)):
        assert decoding.sampler(device, graphs, fsdp) is decoding.decode
    model = mock.Mock(generation_config="the model's")
    model.generate.side_effect = lambda input_ids, **kwargs: torch.cat([input_ids, input_ids[:, :3]], 1)  # 3 tokens
    ids = torch.arange(1, 71).view(2, 35)  # prompts 35 columns wide: padded to 64 for the static cache
    settings = decoding.Sampling(3, [2], 0, 0.9, 50, 1.0)
    out = decoding.generate_with_graphs(model, ids, torch.ones_like(ids), settings)
    call = model.generate.call_args.kwargs
    config, sent, sent_mask = call["generation_config"], call["input_ids"], call["attention_mask"]
    assert (config.cache_implementation, config.do_sample, config.top_k, config.max_new_tokens) == (
        "static",
        True,
        50,
        3,
    )
    assert sent.shape == (2, 64) and (sent[:, :29] == 0).all() and (sent_mask[:, :29] == 0).all()
    assert torch.equal(out[:, :35], ids) and out.shape == (2, 38)  # the extra columns dropped again
    assert model.generation_config == "the model's"  # put back after the call


# ---------- LoRA: each merged weight made as vLLM takes it ----------
def test_lora_merged_weights_are_made_one_at_a_time(make_trainer):
    """Before, every delta B A was built at once before vLLM got the first weight: 5.2 GB of float32 at
    Qwen2.5-1.5B's shape with all-linear targets (docs/gpu.md). Now the live deltas never exceed the largest one."""
    model = make_trainer(lora_r=4, eval_steps=100).model
    for module in model.modules():  # B is zero at the start: give the adapters a delta to merge
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)
    made = []
    for module in model.modules():
        if hasattr(module, "get_delta_weight"):
            delta_of = module.get_delta_weight

            def recorded(adapter, delta_of=delta_of):
                delta = delta_of(adapter)
                made.append((weakref.ref(delta), delta.numel() * delta.element_size()))
                return delta

            module.get_delta_weight = recorded
    live, expected = [], {}
    for name, tensor in merged_weights(model):
        live.append(sum(size for ref, size in made if ref() is not None))
        if made and name.endswith("q_proj.weight") and not expected:
            expected = {"base": model.get_base_model().get_submodule(name[: -len(".weight")]).base_layer.weight}
            expected["merged"] = tensor.clone()
        del tensor
    assert len(made) == 2 * 7 and max(live) == max(size for _, size in made)  # 2 layers x 7 linear layers
    delta = expected["merged"] - expected["base"]
    assert delta.abs().max() > 0.01  # the adapter merged in


# ---------- vLLM: the start-up copy and one device read per call ----------
class FakeLLM:
    """vllm.LLM's constructor as VllmSampler calls it: what the model folder held (its weights' dtypes)."""

    def __init__(self, model, **settings):
        with safetensors.safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
            self.dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
            self.start_sum = checksum((name, f.get_tensor(name)) for name in f.keys())
        self.settings = settings

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        drawn = [{5: SimpleNamespace(logprob=-1.0)}, {6: SimpleNamespace(logprob=-2.0)}]  # 2 tokens, their log-probs
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, 6], logprobs=drawn)]) for _ in prompts]


def test_vllm_starts_from_a_copy_in_its_dtype_and_reads_the_prompts_back_once(make_trainer, monkeypatch):
    """The start-up copy (in RAM and in the temporary folder) was float32 whatever the engine's dtype: 6.2 GB per
    rank at 1.5B, 3.1 GB in bf16. sample() read each prompt row back on its own (1,024 reads a rollout)."""
    monkeypatch.setattr(vllm_sampler.vllm, "LLM", FakeLLM)
    model = make_trainer(eval_steps=100).model
    sampler = VllmSampler(model, "cpu", torch.bfloat16)
    assert sampler.llm.dtypes == {"BF16"} and sampler.llm.settings["dtype"] is torch.bfloat16
    ids = torch.randint(1, 50, (8, 6))
    mask = torch.ones_like(ids).index_fill_(1, torch.tensor([0, 1]), 0)  # left padding
    with HostReads("vllm_sampler.py") as counted:
        joined, log_probs = sampler.sample(ids, mask, 0, 1.0, 1.0, 0, 2, [])
    assert counted.count == 2  # the ids and the mask, once each, whatever the number of rows
    assert joined[:, 6:].tolist() == [[5, 6]] * 8 and log_probs.tolist() == [[-1.0, -2.0]] * 8


# ---------- sleep mode: vLLM 0.32's rules ----------
class SleepModeBroken(AssertionError):
    """A call that vLLM 0.32 would answer with a CUDA error, a hang or stale weights."""


class SleepRulesLLM(FakeLLM):
    """vllm.LLM as sleep mode sees it, with vLLM 0.32's rules, read from its source:

    device_allocator/cumem.py (CuMemAllocator): each allocation has a tag and is_asleep. sleep(offload_tags) unmaps
    every mapped allocation, copying those whose tag is offloaded to CPU first and discarding the rest; asleep ones
    are left alone. wake_up(tags) maps the asleep allocations whose tag is in tags or is not deferrable (only
    "weights" and "kv_cache" are, device_allocator DEFERRABLE_TAGS), restoring a CPU copy where there is one.
    device_allocator/sleep_mode_backend.py: level 1 offloads weights, runtime, cudagraph; level 2 no weights.
    v1/executor/abstract.py: sleeping_tags; sleep() does nothing while "weights" sleeps; wake_up(tags) does nothing
    when nothing sleeps or a tag is not sleeping, else removes the tags it woke (all for None).
    v1/engine/core.py: sleep(level >= 1) pauses the scheduler; wake_up resumes it only once nothing sleeps.
    Here a map of a mapped allocation (a double cuMemMap), a weight load or generate on unmapped memory, generate on
    a paused scheduler (it would wait for ever) or on discarded weights raise SleepModeBroken."""

    DEFERRABLE = ("weights", "kv_cache")

    def __init__(self, model, **settings):
        super().__init__(model, **settings)
        self.memory = {tag: dict(mapped=True, content=tag, backup=None) for tag in ("weights", "kv_cache", "runtime")}
        self.memory["weights"]["content"] = self.start_sum
        self.sleeping_tags, self.paused, self.read = set(), False, []

    # the allocator
    def map(self, tag):
        allocation = self.memory[tag]
        if allocation["mapped"]:
            raise SleepModeBroken(f"{tag} mapped twice")
        allocation.update(mapped=True, content=allocation["backup"], backup=None)  # None: discarded, garbage

    def allocator_sleep(self, offload_tags):
        for tag, allocation in self.memory.items():
            if allocation["mapped"]:
                backup = allocation["content"] if tag in offload_tags else None
                allocation.update(mapped=False, content=None, backup=backup)

    def allocator_wake_up(self, tags):
        for tag, allocation in self.memory.items():
            if not allocation["mapped"] and (tags is None or tag in tags or tag not in self.DEFERRABLE):
                self.map(tag)

    # the executor and the engine
    def sleep(self, level=1, mode="abort"):
        self.paused = True
        if level >= 1 and "weights" not in self.sleeping_tags:
            self.allocator_sleep(("runtime", "cudagraph") + (("weights",) if level == 1 else ()))
            self.sleeping_tags |= {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        tags = None if tags is None else [tag for tag in tags if tag != "scheduling"]
        if self.sleeping_tags and (tags is None or set(tags) <= self.sleeping_tags) and tags != []:
            self.allocator_wake_up(tags)
            self.sleeping_tags -= set(self.sleeping_tags if tags is None else tags)
        self.paused = self.paused and bool(self.sleeping_tags)
        return not self.sleeping_tags

    def asleep(self):
        return not any(allocation["mapped"] for allocation in self.memory.values())

    # what uses the memory
    def collective_rpc(self, method, kwargs=None):
        if not self.memory["weights"]["mapped"]:
            raise SleepModeBroken(f"{getattr(method, '__name__', method)} on unmapped weights")
        if method == "reload_weights":
            self.memory["weights"]["content"] = checksum(kwargs["weights_iterator"])

    def reset_prefix_cache(self):  # the scheduler's block tables: no device memory
        return True

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        if self.paused or not all(allocation["mapped"] for allocation in self.memory.values()):
            raise SleepModeBroken(f"generate with the scheduler paused or memory asleep: {self.memory}")
        if self.memory["weights"]["content"] is None:
            raise SleepModeBroken("generate on discarded weights")
        self.read.append(self.memory["weights"]["content"])
        return super().generate(prompts, params)


def test_the_fake_engine_keeps_vllm_032s_sleep_rules(make_trainer, monkeypatch):
    """The rules have teeth: a weight load into sleeping weights, generate before the KV cache is back, generate
    on weights a level-2 sleep discarded, a double map; TRL's order (wake weights, sync, wake kv_cache, generate,
    sleep) passes them."""
    monkeypatch.setattr(vllm_sampler.vllm, "LLM", SleepRulesLLM)
    llm = VllmSampler(make_trainer(eval_steps=100).model).llm

    def sync():
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([("w", torch.ones(2))])})

    llm.sleep(level=1)
    with pytest.raises(SleepModeBroken, match="unmapped weights"):
        sync()
    llm.wake_up(tags=["weights"])
    sync()
    with pytest.raises(SleepModeBroken, match="paused"):
        llm.generate([], [])
    assert llm.wake_up(tags=["kv_cache"]) and llm.generate([], []) == [] and llm.read == [2.0]
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(SleepModeBroken, match="discarded"):
        llm.generate([], [])
    with pytest.raises(SleepModeBroken, match="mapped twice"):
        llm.map("weights")


def test_the_trainers_sleep_mode_calls_keep_vllm_032s_rules(make_trainer, monkeypatch):
    """Evaluations and rollouts with vllm_enable_sleep_mode: every call passes the rules; vLLM's memory is all asleep
    during every training micro-step; every generate reads the weights the policy had at that moment."""
    monkeypatch.setattr(vllm_sampler.vllm, "LLM", SleepRulesLLM)
    settings = dict(use_vllm=True, vllm_enable_sleep_mode=True, vllm_logprob_diff_threshold=0, filter_metric="none")
    settings |= dict(weight_decay=0.1)  # the fake's responses all score alike: AdamW's decay moves the weights
    trainer = make_trainer(max_steps=3, eval_steps=2, **settings)
    engine, asleep, policy = trainer.vllm.llm, [], []
    train_step, generate = trainer.train_step, trainer.vllm.generate

    def checked_train_step(*args, **kwargs):
        asleep.append(engine.asleep())
        return train_step(*args, **kwargs)

    def checked_generate(*args, **kwargs):
        policy.append(checksum(policy_weights(trainer.model)))
        return generate(*args, **kwargs)

    trainer.train_step, trainer.vllm.generate = checked_train_step, checked_generate
    trainer.train()
    assert trainer.update_steps == 3 and asleep == [True] * 6  # 3 steps x 2 micro-steps
    assert len(policy) == 5 and engine.read == policy  # evaluations at steps 0 and 2, 3 rollouts
    assert len(set(policy)) == 3  # the weights of steps 0, 1, 2


def test_vllm_wakes_only_after_the_trainers_cached_blocks_are_released(make_trainer, monkeypatch):
    """On CUDA torch's caching allocator keeps the blocks training freed; vLLM's wake_up maps its memory from the
    driver, so torch.cuda.empty_cache() comes first, before every wake_up (TRL's order). Here both are recorded:
    in 2 steps: the evaluation at step 0 and step 1's rollout sample; step 2's syncs step 1's weights, samples."""
    calls = []

    class RecordingLLM(SleepRulesLLM):
        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))
            return super().wake_up(tags)

    monkeypatch.setattr(vllm_sampler.vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None)))
    settings = dict(use_vllm=True, vllm_enable_sleep_mode=True, vllm_logprob_diff_threshold=0, filter_metric="none")
    make_trainer(max_steps=2, eval_steps=100, **settings).train()
    wakes = [("wake_up", None)] * 2 + [("wake_up", ["weights"]), ("wake_up", None)]
    assert calls == [call for wake in wakes for call in (("empty_cache", None), wake)]


# ---------- torchrun: the collectives' timeout ----------
def test_ddp_timeout_reaches_init_process_group(make_trainer, monkeypatch):
    """NCCL's own 10 minutes can run out while rank 0 alone writes a 1.5B checkpoint; Hugging Face's 1800 s."""
    seen = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    record = lambda backend, timeout: seen.append((backend, timeout))  # noqa: E731
    monkeypatch.setattr(distributed.dist, "init_process_group", record)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.atexit, "register", lambda handler: None)
    monkeypatch.setattr(distributed.dist, "all_gather_object", lambda gathered, mine: gathered.__setitem__(0, mine))
    monkeypatch.setattr(distributed, "PROCESSES", [])  # setup's (host, PID) of each rank, this test's alone
    assert distributed.setup("cpu", 0, train.DapoArguments.ddp_timeout).size == 2
    assert seen == [("gloo", datetime.timedelta(seconds=1800))]
    monkeypatch.setattr(train.distributed, "setup", lambda device, timeout: seen.append(timeout) or distributed.World())
    monkeypatch.delenv("WORLD_SIZE")
    make_trainer(ddp_timeout=7200, eval_steps=100)
    assert seen[-1] == 7200


# ---------- a micro-step's reads, and the step's own peak memory ----------
def test_a_micro_step_reads_from_the_device_twice(make_trainer):
    """Before: mask.any(), one .item() per diagnostic (3 or 4), loss.item(), int(token count): 6 or 7 reads."""
    trainer = make_trainer(beta=0.04, filter_metric="none", eval_steps=100)
    kept, _ = trainer.generate_experiences(make_batch(trainer, 2))
    inputs = trainer.make_micro_batches(kept)[0]
    with HostReads("train.py", "trackers.py") as counted:
        metrics = trainer.train_step(trainer.model, inputs, None)
    assert counted.count == 2
    assert metrics["num_tokens"] == int(inputs.action_mask.sum()) and isinstance(metrics["num_tokens"], int)
    assert {"loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean"} <= set(metrics)


def test_peak_memory_gb_is_each_steps_own(make_trainer, monkeypatch):
    """peak_memory_gb was the peak since the start (vLLM's pool and the first evaluation included) in every record."""
    trainer = make_trainer(eval_steps=100)
    allocator = {"now": 1.0, "peak": 5.0}  # GiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"] * 2**30)
    reset = lambda device=None: allocator.update(peak=allocator["now"])  # noqa: E731
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    trainer.args.device = "cuda"  # log_step alone: nothing runs on it
    trainer.progress = SimpleNamespace(set_postfix=lambda *args, **kwargs: None, update=lambda n: None)
    trainer.log_step({"loss": [0.5], "time/step": [1.0]})
    allocator["peak"] = max(allocator["peak"], 3.0)  # the second step's own peak
    trainer.log_step({"loss": [0.25], "time/step": [1.0]})
    assert [record["peak_memory_gb"] for record in trainer.history] == [5.0, 3.0]


# ---------- gpu_check.sh on a machine without datasets and vLLM ----------
def test_gpu_check_dry_run_reports_every_part_without_datasets_and_vllm(tmp_path):
    """`gpu_check.sh --cpu` on a Python where `import datasets` and `import vllm` fail: every part reports, FSDP
    under torchrun with one process resumes a SIGTERM'd run, the sampler's CUDA path (run eagerly) draws what generate
    draws, the parts that need the missing packages say so."""
    shadow = tmp_path / "shadow"
    for name in ("datasets", "vllm"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    env = dict(
        os.environ, PYTHON=sys.executable, PYTHONPATH=str(shadow), OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1"
    )
    script = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
    done = subprocess.run(
        ["bash", script, "--cpu", "env", "fsdp", "graphs", "vllm_call", "speed", "multi"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("gpu_check summary (cpu;")[1].splitlines()[1:]
    assert [line.split()[:2] for line in summary] == [
        ["ok", "env"], ["ok", "fsdp"], ["ok", "graphs"], ["skipped", "vllm_call:"], ["skipped", "speed:"],
        ["skipped", "torchrun_2:"],
    ]  # fmt: skip
    assert "needs vllm" in summary[3] and "needs datasets" in summary[4] and "needs 2 GPUs" in summary[5]
    assert "ok     generate_with_graphs draws what plain generate draws (greedy)" in done.stdout
    assert (
        "datasets     missing (ImportError" in done.stdout
        and "pip download datasets==5.2.0 vllm==0.32.0" in done.stdout
    )
    assert "ok     every restored tensor on the model's device" in done.stdout
    assert "ok     a checkpoint with buffered groups and a half-done rollout" in done.stdout
