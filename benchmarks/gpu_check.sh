#!/usr/bin/env bash
# The GPU check: what a CPU suite cannot show, on a rented GPU machine with no network (docs/gpu.md).
#
#   bash benchmarks/gpu_check.sh              the check: env, resume, fsdp, logprobs (at most 8 min 20 s on one GPU)
#   bash benchmarks/gpu_check.sh vllm         vLLM: one call of 64 prompts x G 16, sleep mode (at most 7 min)
#   bash benchmarks/gpu_check.sh speed        s/step and peak memory at Qwen2.5-1.5B's shape, use_vllm off, on (9 min)
#   bash benchmarks/gpu_check.sh graphs       the default sampler's CUDA graphs against plain generate (at most 4 min)
#   bash benchmarks/gpu_check.sh long         padding_free against padded passes; a micro-step at 4k-16k tokens (9 min)
#   bash benchmarks/gpu_check.sh multi        2 GPUs or more: torchrun, an engine per GPU (DDP + sleep, FSDP; 8 min)
#   bash benchmarks/gpu_check.sh all          every part (limits adding to 45 minutes)
#   bash benchmarks/gpu_check.sh --cpu [...]  no GPU: the same parts on the CPU, small shapes (the suite's dry run)
#
# Parts can also be named one by one (env resume fsdp logprobs graphs vllm_call sleep speed padding_free
# long_responses torchrun_2). Each part runs under its own time limit and reports ok, FAILED or skipped (why); a failure never
# stops the parts after it. Nothing is installed and nothing downloaded: the models are random, the problems are
# made in memory. Parts that need a package the machine lacks say so (the env part names what to bring as wheels):
# speed, long and multi run bench.py, log_probs.py and train.py --demo, which read their data with `datasets`.
# Environment: PYTHON (default python3), OUT (logs and results; default a temporary folder), BUDGET_GB (the card
# the memory figures are held against, default 48), VLLM_SHARE (vLLM's share of such a card, default 0.3).
set -uo pipefail # no -e: a failed part is reported and the next one runs
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d)}"
BUDGET_GB="${BUDGET_GB:-48}"
VLLM_SHARE="${VLLM_SHARE:-0.3}"
mkdir -p "$OUT"
export VLLM_LOGGING_STREAM="${VLLM_LOGGING_STREAM:-ext://sys.stderr}" # vLLM's log to each part's log file

mode=cuda
parts=()
for arg in "$@"; do
    case $arg in
    --cpu) mode=cpu ;;
    -h | --help) sed -n '2,19p' "$0" | cut -c3- && exit 0 ;;
    check) parts+=(env resume fsdp logprobs) ;;
    vllm) parts+=(vllm_call sleep) ;;
    speed | multi) parts+=("$arg") ;;
    long) parts+=(padding_free long_responses) ;;
    all) parts+=(env resume fsdp logprobs graphs vllm_call sleep speed padding_free long_responses multi) ;;
    env | resume | fsdp | logprobs | graphs | vllm_call | sleep | padding_free | long_responses | torchrun_2) parts+=("$arg") ;;
    *) echo "gpu_check: unknown part or group '$arg' (see --help)" >&2 && exit 2 ;;
    esac
done
[[ ${#parts[@]} -eq 0 ]] && parts=(env resume fsdp logprobs)
if ! command -v "$PYTHON" >/dev/null; then
    echo "gpu_check: no $PYTHON here: PYTHON=/path/to/python bash benchmarks/gpu_check.sh" >&2
    exit 2
fi

has() { "$PYTHON" -c "import $1" >/dev/null 2>&1; } # an import, not find_spec: a broken install is missing too
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
gpus=${gpus:-0}
device=cuda
[[ $mode == cpu ]] && device=cpu
summary=()
failed=0

# run_part NAME LIMIT_S COMMAND...: the part's findings (stdout) as they come, its stderr to OUT/NAME.log (its last
# lines shown when it fails); ok (exit 0), skipped (exit 77: the reason is its last line), FAILED otherwise.
run_part() {
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "gpu_check: $name (at most $limit s): $*"
    timeout --kill-after=15 "$limit" "$@" 2>"$OUT/$name.log" | tee "$OUT/$name.out" | grep -v '^skipped: '
    status=${PIPESTATUS[0]}
    case $status in
    0) summary+=("ok       $name ($((SECONDS - start)) s)") ;;
    77) summary+=("skipped  $name: $(sed -n 's/^skipped: //p' "$OUT/$name.out" | tail -1)") ;;
    124 | 137) summary+=("FAILED   $name: over its limit of $limit s (log: $OUT/$name.log)") ;;
    *) summary+=("FAILED   $name: exit $status (log: $OUT/$name.log)") ;;
    esac
    if [[ $status != 0 && $status != 77 ]]; then
        failed=1
        grep -v 'it/s\]\|s/it\]\|ba/s\]' "$OUT/$name.log" | tail -15 | sed 's/^/    | /'
    fi
}

skip_part() { # skip_part NAME WHY
    echo "gpu_check: $1: skipped: $2"
    summary+=("skipped  $1: $2")
}

# needs NAME PACKAGE...: true when the part can run here, else it is reported skipped.
needs() {
    local name=$1 package
    shift
    if [[ $mode == cuda && $gpus -eq 0 && $name != env ]]; then
        skip_part "$name" "no CUDA device visible to torch (--cpu runs the CPU dry run)"
        return 1
    fi
    for package in "$@"; do
        if ! has "$package"; then
            skip_part "$name" "needs $package (the env part says how to bring it as wheels)"
            return 1
        fi
    done
}

utilization=$VLLM_SHARE # vLLM's share of this card: what it would get on a BUDGET_GB card
if [[ $mode == cuda && $gpus -gt 0 ]]; then
    share="min($VLLM_SHARE, $VLLM_SHARE * $BUDGET_GB / (torch.cuda.mem_get_info()[1] / 2**30))"
    utilization=$("$PYTHON" -c "import torch; print(f'{$share:.4f}')")
fi
if [[ $mode == cuda ]]; then
    bench=(--shape qwen2.5-1.5b --device cuda --steps 3 --vllm_gpu_memory_utilization "$utilization")
    packed=(--shape qwen2.5-1.5b --device cuda --steps 2 --max_generate_length 300 --lengths 20:300:group)
    long=(--runners ours,ours+gc --device cuda --layers 28 --rows 4 --prompt 256 --fit 1024,2048 --max_gb 40)
    long+=(--lengths 4096,8192,16384)
else
    bench=(--shape small --device cpu --steps 1 --max_generate_length 16 --warmup_tokens 8)
    packed=(--shape small --device cpu --steps 1 --max_generate_length 16 --lengths 4:16:group --warmup_tokens 8)
    long=(--runners ours --device cpu --layers 1 --rows 2 --prompt 16 --fit 16,32 --lengths 64 --max_gb 4)
fi

for part in "${parts[@]}"; do
    at=(--device "$device" --out "$OUT/$part") # gpu_parts.py's runs write there
    case $part in
    env) run_part env 60 "$PYTHON" benchmarks/gpu_parts.py env ;;
    resume) needs resume && run_part resume 150 "$PYTHON" benchmarks/gpu_parts.py resume "${at[@]}" ;;
    fsdp) needs fsdp && run_part fsdp 150 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 \
        benchmarks/gpu_parts.py fsdp "${at[@]}" ;;
    logprobs) needs logprobs && run_part logprobs 120 "$PYTHON" benchmarks/gpu_parts.py logprobs "${at[@]}" ;;
    graphs) needs graphs && run_part graphs 240 "$PYTHON" benchmarks/gpu_parts.py graphs "${at[@]}" ;;
    vllm_call) needs vllm_call vllm && run_part vllm_call 240 "$PYTHON" benchmarks/gpu_parts.py vllm_call "${at[@]}" \
        --vllm_gpu_memory_utilization "$utilization" ;;
    sleep) needs sleep vllm && run_part sleep 180 "$PYTHON" benchmarks/gpu_parts.py sleep "${at[@]}" ;;
    speed) # the default and use_vllm side by side (use_vllm only where vllm is installed)
        vllm=()
        has vllm && vllm=(--vllm)
        needs speed datasets && run_part speed 540 "$PYTHON" benchmarks/bench.py "${vllm[@]}" --no_loss_check \
            --json "$OUT/speed.json" "${bench[@]}" ;;
    padding_free) needs padding_free datasets && run_part padding_free 240 "$PYTHON" benchmarks/bench.py \
        --no_loss_check --batch_size 4 --configs "default (train.py),+padding_free" "${packed[@]}" ;;
    long_responses) needs long_responses datasets && run_part long_responses 300 "$PYTHON" benchmarks/log_probs.py \
        --budget_gb "$BUDGET_GB" "${long[@]}" ;;
    multi | torchrun_2)
        if [[ $mode == cpu || $gpus -lt 2 ]]; then
            skip_part torchrun_2 "needs 2 GPUs or more ($gpus visible; on CPUs tests/test_distributed.py runs it)"
            continue
        fi
        for extra in --vllm_enable_sleep_mode=true --fsdp=true; do
            name="torchrun_2${extra//[^a-z]/_}"
            needs "$name" datasets vllm && run_part "$name" 240 "$PYTHON" -m torch.distributed.run --standalone \
                --nproc_per_node=2 train.py --demo --use_vllm=true --device=cuda "$extra" --max_steps=3 --eval_steps=3 \
                --eval_samples=20 --output_dir="$OUT/$name" --vllm_gpu_memory_utilization=0.2
        done ;;
    esac
done

echo
echo "gpu_check summary ($mode; logs in $OUT):"
printf '  %s\n' "${summary[@]}"
exit $failed
