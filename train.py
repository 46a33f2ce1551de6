"""DAPO: Decoupled Clip and Dynamic Sampling Policy Optimization, in one file.

RL fine-tuning of a chat LLM on grade-school math (GSM8K, Chinese), after the DAPO paper
(ByteDance Seed / Tsinghua AIR, arXiv 2503.14476) and the annotated DAPO notes this project reimplements (the
"seed"; docs/differences-from-seed.md lists where it deviates). Read it top to bottom:

    1. data            Samples (one group), MicroBatch (batch_size groups, padded); the rows: data.GSM8KDataset
    2. settings        DapoArguments (edit the defaults in place, or `--field=value`); presets: dapo_utils/presets.py
    3. DAPO maths      group_advantages, keep_groups, dapo_per_token_loss, aggregate_loss, ...
    4. the trainer     DapoTrainer.train is Algorithm 1 in one loop: sample groups -> rewards ->
                       advantages -> dynamic-sampling filter -> buffer -> micro-batches ->
                       clip-higher token-level loss, accumulated -> optimizer step -> log / eval / save
    5. entry point     python train.py [--demo] [--preset paper] [--resume=latest] [--field=value ...]
A step: gradient_accumulation_steps micro-batches of batch_size valid groups of num_generations responses.
"""

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # read from this file's text: torch takes 5 s
    from dapo_utils.options import print_help

    sys.exit(print_help(__file__))

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

import reward_func  # the seed's four reward functions; --reward_funcs names them
from dapo_utils import distributed, launch
from dapo_utils.checkpoints import deferred_interrupts, load_tokenizer, policy_model, reference_model, resume_run
from dapo_utils.checkpoints import save_final_model, save_run_checkpoint, stop_if_requested
from dapo_utils.cli import check_arguments
from dapo_utils.curves import redraw_curves
from dapo_utils.data import ANSWER_COLUMN, QUESTION_COLUMN, GSM8KDataset, read_system_prompt
from dapo_utils.decoding import Sampling, sampler
from dapo_utils.evaluation import LOGGED_EXAMPLES, EvaluationStopped, evaluate_model, logged_metrics
from dapo_utils.flops import device_roof, log_prob_flops, model_shape, pass_flops, perf_metrics, sampling_metrics
from dapo_utils.guards import check_data_ran_out, check_finite, check_rounds, check_rows, check_weights
from dapo_utils.kernels import bf16_autocast, output_layer_scores, reuse_freed_memory
from dapo_utils.notices import warn
from dapo_utils.options import run_command
from dapo_utils.packing import join_batches, micro_batch_groups, numbered, pack_sequences, pad_and_cat
from dapo_utils.packing import pad_and_cat_groups, padded_sequences, trim_group, unpack
from dapo_utils.presets import preset_fields
from dapo_utils.rewards import answer_checker, load_reward_models, reward_column, reward_func_name
from dapo_utils.rewards import reward_functions, reward_weight_tensor
from dapo_utils.trackers import loss_diagnostics, make_tracker, progress_postfix, round_metrics, step_record
from dapo_utils.writes import append_log

SYSTEM_PROMPT = """
按照如下格式回答问题：
<think>
你的思考过程
</think>
<answer>
你的回答
</answer>
"""
SEED_REWARDS = "correctness_reward,digit_reward,hard_format_reward,mark_reward"  # reward_func.py's four


# ============================================================
# 1. Data (the rows: data.GSM8KDataset)
# ============================================================
@dataclass
class Samples:
    """One group: num_generations responses to one prompt."""

    prompt_response_ids: torch.Tensor  # [G, P+T] left-padded prompt, right-padded response
    response_ids: torch.Tensor  # [G, T]
    prompt: Any  # the question text
    answer: Any  # the reference answer
    attention_mask: torch.LongTensor  # [G, P+T] real prompt tokens + response up to its first EOS
    action_mask: torch.LongTensor  # [G, T] response tokens up to and including the first EOS
    num_actions: int  # T, the padded response length
    response_length: torch.Tensor  # [G] number of response tokens (EOS included)
    sampler_log_probs: Optional[torch.Tensor] = None  # [G, T] vLLM's log-probs of the drawn tokens (use_vllm)
    advantages: Optional[torch.Tensor] = None  # [G] Eq. (9), once scored (generate_experiences)
    sampled_at: int = 0  # the optimizer steps the policy had taken when it was sampled (use_vllm: the gap's lag)
    index: int = 0  # its prompt's place in the epoch's order: the sampling order, in which a step takes its groups


@dataclass
class MicroBatch:
    """batch_size valid groups, padded to one width and concatenated: what one micro-step's loss reads."""

    prompt_response_ids: torch.Tensor  # [N, P+T], N = batch_size * G
    attention_mask: torch.LongTensor  # [N, P+T]
    action_mask: torch.LongTensor  # [N, T] the loss's tokens (0 for an overlong_filter-ed response)
    advantages: torch.Tensor  # [N]
    sampler_log_probs: Optional[torch.Tensor] = None  # [N, T] vLLM's (use_vllm)
    sampler_lag: Optional[torch.Tensor] = None  # [N] steps from the weights that sampled a row to pi_old's (use_vllm)
    old_action_log_probs: Optional[torch.Tensor] = None  # [N, T] pi_old's; None: pi_old = pi_theta (ratio 1)
    ref_action_log_probs: Optional[torch.Tensor] = None  # [N, T] pi_ref's (beta > 0)


# ============================================================
# 2. Settings
# ============================================================
FilterMetric = Literal["reward", "correctness", "none"]  # dynamic sampling's rule
LossAggMode = Literal["seed", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]  # the last: Dr. GRPO
ScaleRewards, ISLevel = Literal["group", "batch", "none"], Literal["token", "sequence"]  # TRL's names and values
Tracker = Literal["none", "tensorboard", "wandb", "trackio"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]  # importance sampling (TRL)
AnswerFormat, Checker = Literal["number", "gsm8k", "latex"], Literal["number", "math_verify"]  # data.py, rewards.py


def arg(default, help, at_least=None):
    """A DapoArguments field whose help text `python train.py --help` prints; at_least: its smallest value. Its
    rules (at_least, a Literal's choices) are checked by cli.check_arguments."""
    return field(default=default, metadata={"help": help, "at_least": at_least})


@dataclass
class DapoArguments:
    # --- data and prompt ---
    model_path: str = arg("./Qwen2.5-1.5B-Instruct", "policy: a Hugging Face folder or a .gguf file")
    data_path: str = arg("./gsm8k_chinese", "swulling/gsm8k_chinese's folder, or any local data set (docs/own-data.md)")
    test_size: int = arg(100, "train rows held out as the test split when the data set has none", at_least=1)
    question_column: str = arg(QUESTION_COLUMN, "the data set's question column (the seed's)")
    answer_column: str = arg(ANSWER_COLUMN, "its reference answer column (the seed's)")
    answer_format: AnswerFormat = arg("number", "answers: 'number' (seed), 'gsm8k' (after ####), 'latex' (\\boxed{})")
    system_prompt: str = arg(SYSTEM_PROMPT, "the system prompt, or @FILE: a file's text (the seed's, Chinese)")
    # --- the run: where it writes, where it runs, its random numbers ---
    output_dir: str = arg("./output", "logs, checkpoints and the final model go here")
    overwrite_output_dir: bool = arg(False, "a fresh run may clear an earlier run's logs and checkpoints there (TRL)")
    device: str = arg("cuda" if torch.cuda.is_available() else "cpu", "where the model runs")
    seed: int = arg(42, "seeds torch's random numbers (sampling, shuffling, evaluation subsets)")
    # --- optimisation (seed: plain Adam, constant lr) ---
    lr: float = arg(0.000001, "learning rate (seed and paper: 1e-6); 0 samples and logs without learning", at_least=0)
    epoch: int = arg(3, "passes over the training prompts", at_least=1)
    max_steps: int = arg(0, "stop after this many optimizer steps; 0 = run every epoch", at_least=0)
    gradient_accumulation_steps: int = arg(2, "micro-batches per optimizer step", at_least=1)
    batch_size: int = arg(1, "prompts per sampling round = valid groups per micro-batch", at_least=1)
    steps_per_generation: int = arg(1, "optimizer steps per rollout: its groups split into this many (TRL)", at_least=1)
    num_iterations: int = arg(1, "optimizer passes over each rollout (>1: PPO-style reuse)", at_least=1)
    weight_decay: float = arg(0.0, "> 0: AdamW with this decoupled decay (verl's DAPO script: 0.1)", at_least=0)
    warmup_steps: int = arg(0, "linear lr warm-up over this many optimizer steps (verl's DAPO script: 10)", at_least=0)
    max_grad_norm: float = arg(0.0, "clip the gradient norm to this; 0 = off (verl's DAPO script: 1.0)", at_least=0)
    # --- sampling ---
    num_generations: int = arg(4, "G: responses per prompt (group size; paper: 16)")
    max_prompt_length: int = arg(256, "longer prompts keep their last tokens", at_least=1)
    max_generate_length: int = arg(128, "max new tokens per response (the paper's L_max)", at_least=1)
    temperature: float = arg(0.9, "sampling temperature (seed 0.9; verl's DAPO recipe 1.0)")
    top_p: float = arg(1.0, "nucleus sampling; 1.0 = off")
    top_k: int = arg(50, "top-k sampling; 0 = off (seed 50; verl's DAPO recipe off)", at_least=0)
    score_with_temperature: bool = arg(False, "log-probs under logits / temperature, the sampling policy (TRL, verl)")
    generation_batch_size: int = arg(0, "prompts per sampling call, all ranks; 0 = what the rollout needs", at_least=0)
    max_generation_rows: int = arg(256, "at most this many responses per sampling call (whole groups)", at_least=1)
    # --- rewards and dynamic sampling ---
    reward_funcs: str = arg(SEED_REWARDS, "reward_func.py's function names, or module:function paths of your own")
    reward_weights: Optional[List[float]] = arg(None, "one weight per reward function; None = all 1.0")
    answer_checker: Checker = arg("number", "compare answers as numbers (seed) or as maths: 'math_verify'")
    reward_timeout: float = arg(600.0, "seconds a reward call may take, then the run stops; 0 = no limit", at_least=0)
    filter_metric: FilterMetric = arg(
        "reward", "skip a group: 'reward' if all totals are equal (seed), 'correctness' Eq. 11, 'none' never"
    )
    scale_rewards: ScaleRewards = arg("group", "advantage / std of the 'group' (seed) or 'batch'; 'none': Dr. GRPO")
    max_num_gen_batches: int = arg(0, "max sampling rounds to fill one optimizer step; 0 = no limit", at_least=0)
    max_empty_rounds: int = arg(200, "stop after this many rounds in a row keep no group; 0 = never (seed)", at_least=0)
    overlong_buffer_len: int = arg(0, "overlong punishment of the last this many tokens (L_cache, Eq. 13); 0 = off")
    overlong_penalty_factor: float = arg(1.0, "scale of that punishment (-factor at max_generate_length)", at_least=0)
    overlong_filter: bool = arg(False, "mask out the loss of responses that hit max_generate_length without EOS")
    # --- loss ---
    beta: float = arg(0.0, "KL coefficient; 0 = no reference model (saves memory)", at_least=0)
    clip_eps_low: float = arg(0.2, "ratio clipped below at 1 - clip_eps_low")
    clip_eps_high: float = arg(0.28, "ratio clipped above at 1 + clip_eps_high (clip-higher)")
    loss_agg_mode: LossAggMode = arg("seed", "'seed' per-group token mean, 'token-mean' Eq. 12, GRPO's, Dr. GRPO's")
    importance_sampling_level: ISLevel = arg("token", "ratio per 'token' (seed) or per response, 'sequence' (GSPO)")
    # --- evaluation, logs and checkpoints ---
    eval_steps: int = arg(10, "evaluate every this many optimizer steps (and before training)", at_least=1)
    eval_samples: int = arg(100, "random test problems per evaluation; 0 = the whole split", at_least=0)
    eval_num_generations: int = arg(1, "k responses per test problem; k > 1 adds pass@k and maj@k", at_least=1)
    eval_batch_size: int = arg(20, "prompts per sampling call during evaluation", at_least=1)
    save_steps: int = arg(100, "write output_dir/checkpoint_N every this many optimizer steps", at_least=1)
    save_total_limit: int = arg(0, "keep only the newest this many checkpoints; 0 = all (TRL's name)", at_least=0)
    report_to: Tracker = arg("none", "also log metrics to TensorBoard, Weights & Biases or Trackio")
    # --- speed and memory ---
    bf16: bool = arg(True, "on CUDA, autocast forward passes to bf16 (weights stay float32)")
    tf32: bool = arg(True, "on CUDA, TF32 matmuls for what stays float32")
    num_threads: int = arg(0, "torch's CPU threads; 0 = torch's default, one per core (the demo: 1)", at_least=0)
    padding_free: bool = arg(False, "log-prob and loss passes on real tokens only, packed in one row (verl)")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward: less memory, ~30%% slower")
    cuda_graphs: bool = arg(True, "on CUDA, decode over a static KV cache replayed as CUDA graphs (not with fsdp)")
    # --- vLLM ---
    use_vllm: bool = arg(False, "sample with vLLM in this process (pip install -r requirements/vllm.txt; TRL's name)")
    vllm_gpu_memory_utilization: float = arg(0.3, "share of GPU memory vLLM may take (TRL's default)")
    vllm_enable_sleep_mode: bool = arg(False, "on CUDA, vLLM frees its memory between rollouts (TRL's name)")
    vllm_importance_sampling_cap: float = arg(0.0, "> 0: weight by pi_old / pi_vLLM, capped (verl: 2)", at_least=0)
    vllm_importance_sampling_mode: ISMode = arg("token_truncate", "that weight per token or response; cap: cut or mask")
    vllm_logprob_diff_threshold: float = arg(0.1, "stop if mean |log pi_old - log pi_vLLM| > this; 0 = off", at_least=0)
    # --- LoRA ---
    lora_r: int = arg(0, "LoRA rank: > 0 trains adapters alone; 0 = full fine-tuning (verl's lora_rank)", at_least=0)
    lora_alpha: float = arg(16.0, "adapters' update scaled by lora_alpha / lora_r (verl's name, default 16)")
    lora_dropout: float = arg(0.0, "dropout on the adapters' input (peft's default 0: one policy samples and learns)")
    lora_target_modules: str = arg("all-linear", "'all-linear' (the decoder's linear layers; verl) or 'q_proj,v_proj'")
    vllm_sync_adapters: bool = arg(False, "LoRA + use_vllm: push the adapters alone, vLLM applies them (else merged)")
    merge_lora: bool = arg(False, "LoRA: also write output_dir/merged, base + adapters, a model loadable alone (TRL)")
    # --- several processes (torchrun) ---
    fsdp: bool = arg(False, "under torchrun, shard parameters, gradients and Adam states over the processes (FSDP2)")
    ddp_timeout: int = arg(1800, "seconds a process waits for the others in a collective (Hugging Face's)", at_least=1)

    def __post_init__(self):
        self.system_prompt = read_system_prompt(self.system_prompt)  # @FILE: its text, as dapo_args.json keeps it
        self.validate()

    def validate(self):
        """Reject bad settings up front, naming the field and the fix (the rules: cli.check_arguments)."""
        check_arguments(self)


# ============================================================
# 3. DAPO maths: small pure functions, each with its equation
# ============================================================
def group_advantages(rewards, scale_rewards="group"):
    """GRPO/DAPO advantage, Eq. (9): A_i = (R_i - mean(R)) / (std(R) + 1e-8) within each group.

    rewards: [B, G] -> advantages [B, G]; std is the unbiased one, as torch.std and the seed. scale_rewards (TRL's):
    "group" divides by each group's std (Eq. 9), "batch" by the std of all B * G rewards (the sampling call's, on
    this process), "none" by nothing: A_i = R_i - mean(R), Dr. GRPO (arXiv 2503.20783, Sec. 3.2). A group whose
    rewards are all equal gets exactly 0: in float32 their mean can differ from them (G = 8 times 0.3).
    """
    mean = rewards.mean(dim=1, keepdim=True)  # [B, 1]
    std = {"group": rewards.std(dim=1, keepdim=True), "batch": rewards.std(), "none": None}[scale_rewards]
    advantages = rewards - mean if std is None else (rewards - mean) / (std + 1e-8)
    equal = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # [B, 1]
    return advantages.masked_fill(equal, 0.0)


def keep_groups(advantages, correct, filter_metric):
    """Dynamic sampling, Eq. (11): which groups carry a learning signal. Returns [B] bool.

    "reward":      some advantage is non-zero (the seed's rule: skip when all totals are equal)
    "correctness": 0 < number of correct responses < G (the paper's rule)
    "none":        keep every group (GRPO)
    """
    if filter_metric == "reward":
        return advantages.count_nonzero(dim=1) > 0
    if filter_metric == "correctness":
        num_correct = correct.sum(dim=1)
        return (num_correct > 0) & (num_correct < correct.size(1))
    return torch.ones(advantages.size(0), dtype=torch.bool, device=advantages.device)


def soft_overlong_punishment(lengths, max_length, cache_length, penalty_factor=1.0):
    """DAPO Eq. (13), on response lengths |y| in tokens (EOS included), scaled by penalty_factor:

        R(y) = 0                                    if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                   if |y| > L_max
    lengths: [N] -> [N] float32.
    """
    expected = max_length - cache_length
    return penalty_factor * ((expected - lengths.float()) / cache_length).clamp(min=-1.0, max=0.0)


def response_mask(response_ids, eos_token_ids, generated_length):
    """1 for each response token up to and including its first EOS (so that the policy learns to stop), 0 after.

    [N, T] -> [N, T] long. A response without EOS keeps its `generated_length` tokens (cut at the budget).
    """
    is_eos = torch.isin(response_ids, torch.tensor(eos_token_ids, device=response_ids.device))
    positions = torch.arange(response_ids.size(1), device=response_ids.device)
    first_eos = torch.where(is_eos, positions, response_ids.size(1)).min(dim=1).values  # [N]
    length = torch.where(first_eos < response_ids.size(1), first_eos + 1, generated_length)
    return (positions.unsqueeze(0) < length.unsqueeze(1)).long()


def is_truncated(response_ids, response_lengths, eos_token_ids):
    """[N] bool: the response ran out of budget, i.e. its last kept token is not an EOS."""
    last_token = response_ids.gather(1, (response_lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return ~torch.isin(last_token, torch.tensor(eos_token_ids, device=response_ids.device))


def sequence_log_ratio(log_probs, old_log_probs, mask):
    """GSPO's importance ratio (arXiv 2507.18071, Eq. 7), in log space, one per response:

        log s_i = (1 / |o_i|) * sum_t (log pi(o_t) - log pi_old(o_t))     over the response's tokens (mask)
    [N, T] -> [N, 1]. The gradient reaches every token's log pi, each weighted 1 / |o_i|.
    """
    return ((log_probs - old_log_probs) * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def dapo_per_token_loss(log_probs, old_log_probs, advantages, clip_eps_low, clip_eps_high, sequence_mask=None):
    """Clip-higher surrogate, Eq. (10), per token:

        loss_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A),   r_t = pi(o_t) / pi_old(o_t)

    log_probs, old_log_probs: [N, T]; advantages: [N] (one per response, broadcast over tokens).
    sequence_mask ([N, T], importance_sampling_level="sequence"): r_t is GSPO's s_i (sequence_log_ratio) at every
    token of response i, so the clip keeps or drops a response whole. Returns (loss [N, T], ratio [N, T]).
    """
    log_ratio = log_probs - old_log_probs  # [N, T]
    if sequence_mask is not None:
        log_ratio = sequence_log_ratio(log_probs, old_log_probs, sequence_mask).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    advantages = advantages.unsqueeze(1)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def k3_kl(log_probs, ref_log_probs, mask):
    """Schulman's k3 estimator of KL(pi || pi_ref), per token: exp(ref - logp) - 1 - (ref - logp).

    The log-ratio is masked before exp, as in the seed: padding would give exp(large) * 0 = NaN.
    """
    log_ratio = (ref_log_probs - log_probs) * mask
    return log_ratio.exp() - 1 - log_ratio


def loss_normaliser(action_mask, mode, num_generations, max_length=None):
    """What one micro-batch adds to its optimizer step's loss denominator: tokens ("token-mean"), responses
    ("seq-mean-token-mean"), groups ("seed"), or responses * max_length ("seq-mean-token-sum-norm", Dr. GRPO's
    constant: max_generate_length; None = the padded width T, verl's default). action_mask: [N, T]."""
    if mode == "token-mean":
        return int(action_mask.sum())
    if mode == "seq-mean-token-sum-norm":
        return action_mask.size(0) * (action_mask.size(1) if max_length is None else max_length)
    return action_mask.size(0) if mode == "seq-mean-token-mean" else action_mask.size(0) // num_generations


def aggregate_loss(per_token_loss, mask, mode, num_generations, normaliser=None, max_length=None):
    """This micro-batch's share of its optimizer step's loss: a sum over its units / the step's unit count.

      "seed":                    per group, sum over its G responses' tokens / its token count; mean over groups
      "token-mean":              Eq. (12): sum over every token of the step / the step's token count
      "seq-mean-token-mean":     GRPO: each response's token mean, then the mean over responses
      "seq-mean-token-sum-norm": Dr. GRPO (Sec. 3.2): sum over every token / (responses * max_length), a constant
    per_token_loss, mask: [N, T]. normaliser: the step's total of loss_normaliser over its micro-batches
    (None: this micro-batch is the whole step). Fully masked groups or responses contribute 0.
    """
    per_token_loss = per_token_loss * mask
    if mode == "seed":
        group_sums = per_token_loss.view(-1, num_generations, mask.size(1)).sum(dim=(1, 2))  # [B]
        group_tokens = mask.view(-1, num_generations, mask.size(1)).sum(dim=(1, 2))  # [B]
        total = (group_sums / group_tokens.clamp(min=1)).sum()
    elif mode == "seq-mean-token-mean":
        total = (per_token_loss.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
    else:  # "token-mean", "seq-mean-token-sum-norm": every token alike
        total = per_token_loss.sum()
    normaliser = loss_normaliser(mask, mode, num_generations, max_length) if normaliser is None else normaliser
    return total / max(normaliser, 1)


# ============================================================
# 4. The trainer
# ============================================================
@dataclass
class LoopState:
    """Where Algorithm 1 is. Saved in every checkpoint, so that a resumed run continues exactly."""

    update_steps: int = 0  # optimizer steps taken
    epoch: int = 0  # current pass over the training prompts
    batches_done: int = 0  # prompt batches consumed in this epoch (by all ranks)
    rounds: int = 0  # prompt batches sampled (by all ranks) since the last rollout was complete
    skipped_groups: int = 0  # groups this process dropped by dynamic sampling, whole run (logged: over all)
    truncated_prompts: int = 0  # prompts longer than max_prompt_length (cut from the left), whole run
    buffer: list = field(default_factory=list)  # valid groups (Samples) this process sampled, not yet trained
    rollout: Optional[list] = None  # the MicroBatches being trained on (this process's part)
    updates_done: int = 0  # optimizer steps taken on the rollout
    world_size: int = 1  # processes training together (torchrun); another number resumes regrouped
    metrics: dict = field(default_factory=dict)  # the step in progress's metrics, kept by a stop for the resumed run
    evaluation_pending: bool = False  # a stop came during step update_steps's evaluation: resumed, it runs first

    def state_dict(self):  # groups and micro-batches as dicts: a checkpoint loads with torch.load(weights_only=True)
        rollout = None if self.rollout is None else [vars(m) for m in self.rollout]
        return dict(vars(self), buffer=[vars(group) for group in self.buffer], rollout=rollout)

    def load_state_dict(self, state):  # world_size stays this run's (another number: distributed.regrouped)
        vars(self).update(state, buffer=[Samples(**group) for group in state["buffer"]], world_size=self.world_size)
        self.rollout = None if self.rollout is None else [MicroBatch(**m) for m in self.rollout]


class DapoTrainer:
    def __init__(
        self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, tokenizer=None,
        reward_tokenizers=None,
    ):  # fmt: skip
        self.args = args = args if args is not None else DapoArguments()
        args.validate()  # again: users may have edited fields after construction
        self.world = distributed.setup(args.device, timeout=args.ddp_timeout)  # torchrun: this process's rank
        torch.manual_seed(args.seed + self.world.rank)  # each rank samples differently; the prompt order does not
        # Policy in float32: transformers 5 loads a bf16 checkpoint as bf16, where Adam's 1e-6 steps round
        # away. Forward passes may still autocast to bf16 on CUDA (args.bf16).
        device = "cpu" if args.fsdp else args.device  # --fsdp: each rank's shard goes to the device, not all of it
        self.model = policy_model(model, args, device)  # lora_r > 0: wrapped with LoRA adapters, the base frozen
        self.flop_shape, self.roof = model_shape(self.model), device_roof(args.device, args.bf16, args.tf32)  # perf/*
        self.world.broadcast_parameters(self.model)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if args.device.startswith("cuda"):  # process-wide switches: set both ways
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        else:  # CPU: each decode step's freed logits are reused, not faulted in again (sampling 1.17x faster)
            reuse_freed_memory()
        self.ref_model = reference_model(self.model, args)  # beta == 0: none, half the memory; LoRA: the base, no copy
        if args.fsdp:  # shard the policy and the reference model over the ranks
            from dapo_utils.fsdp import FsdpWorld

            self.world = FsdpWorld.shard_models(self.world, self.model, self.ref_model)
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.tokenizer.padding_side = "left"  # prompts end at the same column, responses start there
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        eos_ids = self.model.generation_config.eos_token_id  # every id that ends a response
        eos_ids = [] if eos_ids is None else [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
        self.eos_token_ids = sorted(set(eos_ids) | {self.tokenizer.eos_token_id})

        self.reward_funcs, self.reward_tokenizers = load_reward_models(reward_funcs, reward_tokenizers, args.device)
        self.reward_names = [reward_func_name(f) for f in self.reward_funcs]
        self.checker = answer_checker(args.answer_checker)  # strict and lenient evaluation compare answers with it
        self.reward_weights = reward_weight_tensor(args.reward_weights, len(self.reward_funcs), args.device)  # [F]
        if args.filter_metric == "correctness" and "correctness_reward" not in self.reward_names:
            raise ValueError('filter_metric="correctness" needs correctness_reward among the reward functions')

        Optimizer = torch.optim.AdamW if args.weight_decay > 0 else torch.optim.Adam  # the seed: Adam, no decay
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = Optimizer(trainable, lr=args.lr, weight_decay=args.weight_decay)
        warmup_factor = lambda step: min(1.0, (step + 1) / max(args.warmup_steps, 1))  # noqa: E731
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_factor)
        # decoding.py: our decode loop (CPU), or generate replaying CUDA graphs; neither reads the model's own
        # generation config (greedy, repetition penalty, ...), which must not change the behaviour policy.
        self.decode = sampler(args.device, args.cuda_graphs, args.fsdp)

        self.vllm = None  # use_vllm: vLLM samples in this process; the policy learns
        if args.use_vllm:
            from dapo_utils.vllm_sampler import VllmSampler

            self.vllm = VllmSampler.for_trainer(self.model, args)  # one per process (torchrun: per rank)

        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.state = LoopState(world_size=self.world.size)
        self.resumed, self.stop_requested = False, False  # stop_requested: by Ctrl-C or SIGTERM (deferred_interrupts)
        self.history = []  # one metrics dict per optimizer step (also written to metrics.jsonl)
        self.last_accuracy, self.eval_record = math.nan, {}  # the last evaluation: strict accuracy, every metric
        self.tracker = make_tracker("none", args.output_dir, None)  # report_to's, from train() on
        self.global_steps, self.empty_rounds, self.progress = 0, 0, None  # train()'s bound, warning count, bar
        self.command = run_command(self.world.size, args.fsdp)  # how a stop line restarts it (launch adds --demo)

    update_steps = property(lambda self: self.state.update_steps)  # the seed's name for optimizer steps taken

    def autocast(self):  # bf16 forward passes on CUDA (args.bf16); a no-op context elsewhere
        return bf16_autocast(self.args)

    # ---- 4.1 sampling ----
    def encode_prompts(self, prompts):
        """Chat-format and left-pad prompts: input_ids, attention_mask [B, P]. A prompt over max_prompt_length keeps
        its last tokens, which hold the generation prompt (`<|im_start|>assistant`) that makes the model answer."""
        template = self.tokenizer.apply_chat_template
        system = {"role": "system", "content": self.args.system_prompt}
        messages = [[system, {"role": "user", "content": p}] for p in prompts]
        texts = [template(m, add_generation_prompt=True, tokenize=False) for m in messages]
        # verbose=False: transformers' "longer than the maximum ... indexing errors" would warn of what is cut below
        token_ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]  # specials: template's
        limit = self.args.max_prompt_length
        too_long = sum(len(ids) > limit for ids in token_ids)
        if too_long and not self.state.truncated_prompts:  # once per run; metrics.jsonl counts them all
            warn(f"prompts longer than max_prompt_length={limit} tokens lose their beginning")
        self.state.truncated_prompts += too_long
        batch = self.tokenizer.pad({"input_ids": [ids[-limit:] for ids in token_ids]}, return_tensors="pt")  # left
        return batch["input_ids"].to(self.args.device), batch["attention_mask"].to(self.args.device)

    @torch.no_grad()
    def sample(self, input_ids, attention_mask):
        """One sampling call with this trainer's settings (decoding.py; temperature 0: greedy). Returns what it
        drew: ids [N, P+T'], T' <= max_generate_length, and vLLM's log-probs of the drawn tokens [N, T'] (None
        without vLLM)."""
        if self.vllm is not None:
            return self.sample_with_vllm(input_ids, attention_mask)
        a, pad = self.args, self.tokenizer.pad_token_id
        settings = Sampling(a.max_generate_length, self.eos_token_ids, pad, a.temperature, a.top_k, a.top_p)
        with self.autocast(), self.world.unsharded(self.model):  # --fsdp: gathered for the whole call
            return self.decode(self.model, input_ids, attention_mask, settings), None

    def sample_with_vllm(self, input_ids, attention_mask, prompt_indices=None):
        """sample() through vLLM, synced to the policy; prompt_indices [N / G] (a rollout) seed each response."""
        a, pad, step = self.args, self.tokenizer.pad_token_id, self.state.update_steps
        self.vllm.follow(self.model, step)  # a rollout: every rank at once; an evaluation syncs before its batches
        seeds = None if prompt_indices is None else self.vllm.rollout_seeds(step, prompt_indices, a.num_generations)
        sampling = (pad, a.temperature, a.top_p, a.top_k, a.max_generate_length, self.eos_token_ids, seeds)
        return self.vllm.sample(input_ids, attention_mask, *sampling)

    def generate_samples(self, inputs):
        """num_generations responses to each prompt of the batch, in one sampling call (or one per
        max_generation_rows responses; vLLM schedules its own memory): a list of Samples."""
        self.model.eval()
        G, pad = self.args.num_generations, self.tokenizer.pad_token_id
        prompts = list(inputs["prompt"])
        answers = list(inputs["answer"]) if "answer" in inputs else [None] * len(prompts)
        prompt_ids, prompt_mask = self.encode_prompts(prompts)  # [B, P]
        prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)
        rows = len(prompt_ids) if self.vllm else max(1, self.args.max_generation_rows // G) * G
        sample = (lambda *x: self.sample_with_vllm(*x, inputs.get("index"))) if self.vllm else self.sample  # seeded
        drawn = [sample(*x) for x in zip(prompt_ids.split(rows), prompt_mask.split(rows))]  # [(ids, log-probs)]
        calls = [ids[:, prompt_ids.size(1) :] for ids, _ in drawn]
        masks = [response_mask(ids, self.eos_token_ids, ids.size(1)) for ids in calls]  # each call's own budget
        action_mask = pad_and_cat(masks, 0)  # [B*G, T]
        response_ids = pad_and_cat(calls, pad).masked_fill(action_mask == 0, pad)  # [B*G, T]
        prompt_response_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B*G, P+T]
        # From the masks, not from `!= pad_token_id`: a pad token that is also the EOS (SmolLM, Llama) would
        # otherwise hide the chat template's own end-of-turn tokens.
        attention_mask = torch.cat([prompt_mask, action_mask], dim=1)  # [B*G, P+T]
        sampler_log_probs = drawn[0][1]  # [B*G, T]: vLLM's, in one call; None without vLLM
        groups = [slice(g * G, (g + 1) * G) for g in range(len(prompts))]
        places = inputs["index"].tolist() if "index" in inputs else [0] * len(prompts)  # in the epoch's order
        samples = []
        for g, prompt, answer, index in zip(groups, prompts, answers, places):  # each as wide as its own tokens
            at, T = trim_group(attention_mask[g], response_ids.size(1))  # columns; the seed's call per prompt
            group = dict(prompt_response_ids=prompt_response_ids[g, at], attention_mask=attention_mask[g, at])
            group |= dict(response_ids=response_ids[g, :T], action_mask=action_mask[g, :T], num_actions=T)
            sampler = None if sampler_log_probs is None else sampler_log_probs[g, :T]
            group |= dict(response_length=action_mask[g].sum(-1), sampler_log_probs=sampler, index=index)
            samples.append(Samples(prompt=prompt, answer=answer, sampled_at=self.state.update_steps, **group))
        return samples

    # ---- 4.2 rewards, advantages, dynamic sampling ----
    @torch.no_grad()
    def score_rewards(self, prompts, responses, answers, failures=None):
        """rewards_per_func [N, F]; NaN where a function returned None (no opinion). failures: see reward_column."""
        funcs, limit = zip(self.reward_names, self.reward_funcs, self.reward_tokenizers), self.args.reward_timeout
        scores = [reward_column(*f, prompts, responses, answers, self.args.device, limit, failures) for f in funcs]
        return torch.stack(scores, dim=1)

    def generate_experiences(self, inputs):
        """Sample groups, score them, compute advantages and drop the groups without signal. Returns the kept
        groups (Samples with their advantages) and {name: values} for the step log."""
        args, G = self.args, self.args.num_generations
        start = time.perf_counter()
        samples_list = self.generate_samples(inputs)
        sampling_time, start = time.perf_counter() - start, time.perf_counter()
        prompts = [s.prompt for s in samples_list for _ in range(G)]
        answers = [s.answer for s in samples_list for _ in range(G)]
        response_ids = pad_and_cat([s.response_ids for s in samples_list], self.tokenizer.pad_token_id)  # [B*G, T]
        responses = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        lengths = torch.cat([s.response_length for s in samples_list])  # [B*G]
        truncated = is_truncated(response_ids, lengths, self.eos_token_ids)  # [B*G]
        failures = {}  # reward_errors/NAME, reward_timeouts/NAME: answer checks that raised or timed out
        rewards_per_func = self.score_rewards(prompts, responses, answers, failures)  # [B*G, F]
        rewards = (rewards_per_func * self.reward_weights).nansum(dim=1)  # [B*G]; None rewards add nothing
        metrics = {f"rewards/{name}": column.tolist() for name, column in zip(self.reward_names, rewards_per_func.T)}
        metrics |= {key: [count] for key, count in failures.items()}
        if args.overlong_buffer_len > 0:  # Eq. (13): part of the reward; its scale is its own factor
            length_args = (args.max_generate_length, args.overlong_buffer_len, args.overlong_penalty_factor)
            penalty = soft_overlong_punishment(lengths, *length_args)  # [B*G]
            rewards = rewards + penalty
            metrics["rewards/soft_overlong_punishment"] = penalty.tolist()
        rewards = rewards.view(-1, G)  # [B, G]
        advantages = group_advantages(rewards, args.scale_rewards)  # [B, G]
        correct = None  # [B, G] bool: what the paper's filter counts
        if "correctness_reward" in self.reward_names:
            correct = rewards_per_func[:, self.reward_names.index("correctness_reward")].view(-1, G) > 0
        keep = keep_groups(advantages, correct, args.filter_metric)  # [B]
        self.state.skipped_groups += int((~keep).sum())

        kept = []
        for g in keep.nonzero().flatten().tolist():
            action_mask = samples_list[g].action_mask  # [G, T]
            if args.overlong_filter:  # a response cut off by the length budget says nothing about its answer
                action_mask = action_mask * ~truncated.view(-1, G)[g].unsqueeze(1)
            kept.append(dataclasses.replace(samples_list[g], action_mask=action_mask, advantages=advantages[g]))
        metrics |= {"time/sampling": [sampling_time], "time/reward": [time.perf_counter() - start]}
        metrics |= round_metrics(rewards, keep, responses, lengths, truncated)  # trackers.py: rewards, skips, lengths
        rows = None if self.vllm else args.max_generation_rows  # per sampling call (generate_samples); vLLM: one
        return kept, metrics | sampling_metrics(self.flop_shape, samples_list, rows, self.roof)  # perf/flops, bound

    def sample_round(self, batches):
        """generate_experiences on this rank's prompt batches of a sampling call. A rank without one still takes
        part in what is collective: --fsdp gathers the policy once for the round, vLLM's engines follow it."""
        if self.vllm is not None:
            self.vllm.follow(self.model, self.state.update_steps)
        with contextlib.nullcontext() if self.vllm else self.world.unsharded(self.model):
            return self.generate_experiences(join_batches(batches)) if batches else ([], {})

    @torch.no_grad()
    def make_micro_batches(self, groups):
        """The rollout's groups (Samples) as MicroBatches of batch_size groups, each padded to its longest, with
        pi_old's and pi_ref's log-probs taken once, on the tensors training will see (packed: balanced by tokens)."""
        args, pad = self.args, self.tokenizer.pad_token_id
        reused = args.num_iterations > 1 or args.steps_per_generation > 1  # else pi_old = pi_theta: ratio 1
        tokens = [int(group.attention_mask.sum()) for group in groups]  # each group's real tokens
        micro_batches = []
        for members in micro_batch_groups(tokens, args.batch_size, args.steps_per_generation, args.padding_free):
            inputs = MicroBatch(**pad_and_cat_groups([groups[g] for g in members], pad, self.state.update_steps))
            model_inputs, ref = self.model_inputs(inputs), self.ref_model
            inputs.old_action_log_probs = self.get_action_log_probs(self.model, *model_inputs) if reused else None
            inputs.ref_action_log_probs = None if ref is None else self.get_action_log_probs(ref, *model_inputs)
            micro_batches.append(inputs)
        return micro_batches

    @staticmethod
    def model_inputs(inputs):
        return inputs.prompt_response_ids, inputs.attention_mask, inputs.action_mask.size(1)

    # ---- 4.3 the DAPO loss ----
    def compute_loss(self, model, inputs, normaliser=None, return_metrics=False):
        """DAPO policy-gradient loss of one micro-batch (Eqs. 10 and 12, plus beta * k3 when beta > 0). normaliser:
        the step's loss denominator (aggregate_loss); None = the whole step. return_metrics: also its diagnostics."""
        args, action_mask = self.args, inputs.action_mask  # [N, T]
        log_probs, entropy = self.get_action_log_probs(model, *self.model_inputs(inputs), with_entropy=True)
        old_log_probs = inputs.old_action_log_probs
        old_log_probs = log_probs.detach() if old_log_probs is None else old_log_probs
        advantages = inputs.advantages  # [N]
        eps = (args.clip_eps_low, args.clip_eps_high)
        per_sequence = action_mask if args.importance_sampling_level == "sequence" else None  # GSPO
        per_token_loss, ratio = dapo_per_token_loss(log_probs, old_log_probs, advantages, *eps, per_sequence)  # [N, T]
        sampler_log_probs, metrics, kl = inputs.sampler_log_probs, {}, None  # [N, T] (use_vllm)
        if sampler_log_probs is not None:  # vLLM drew the tokens, the loss assumes pi_old did: gap, guard, weights
            from dapo_utils.vllm_sampler import sampler_correction

            weight, metrics = sampler_correction(old_log_probs.detach(), inputs, args)
            per_token_loss = per_token_loss * weight  # [N, T]; 1 without vllm_importance_sampling_cap
        if args.beta != 0.0:
            kl = k3_kl(log_probs, inputs.ref_action_log_probs, action_mask)  # [N, T]
            per_token_loss = per_token_loss + args.beta * kl
        units = (args.loss_agg_mode, args.num_generations, normaliser, args.max_generate_length)
        loss = aggregate_loss(per_token_loss, action_mask, *units)
        if not return_metrics:
            return loss
        return loss, metrics | loss_diagnostics(ratio, advantages, entropy, kl, action_mask, *eps)

    # ---- 4.4 log-probabilities ----
    def get_action_log_probs(self, model, input_ids, attention_mask, num_actions, with_entropy=False):
        """log pi(o_t | q, o_<t) of the last num_actions tokens: [N, T] (and the entropy [N, T]). Logits at t predict
        token t+1: only the T positions before the last are computed. Position ids follow the mask, as in generate.
        padding_free: the real tokens alone, in one row (packing.pack_sequences); 0 where there is no token."""
        layout = pack_sequences if self.args.padding_free else padded_sequences  # where: None when padded
        input_ids, inputs, labels, where = layout(input_ids, attention_mask, num_actions)
        temperature = self.args.temperature if self.args.score_with_temperature else 1.0  # the sampling policy's
        with self.autocast(), output_layer_scores(model, labels, temperature):  # no [N, T, V] logits, fwd or bwd
            scores = model(input_ids, **inputs).logits  # [N, T, 2] ([1, K, 2] packed)
        log_probs, entropy = scores[..., 0], scores[..., 1].detach()  # [N, T] each ([1, K] packed)
        if where is not None:
            log_probs, entropy = unpack(log_probs, where), unpack(entropy, where)
        return (log_probs, entropy) if with_entropy else log_probs

    # ---- 4.5 one micro-step ----
    def train_step(self, model, inputs, normaliser=None):
        """Forward and backward one micro-batch; its gradient adds to the step's. Returns its metrics."""
        start = time.perf_counter()
        loss, metrics = self.compute_loss(model, inputs, normaliser, return_metrics=True)
        loss.backward()
        flops = pass_flops(self.flop_shape, inputs.attention_mask, inputs.action_mask.size(1), passes=3)  # fwd + bwd
        numbers = torch.stack([loss.detach().double(), inputs.action_mask.sum().double(), flops])
        loss, num_tokens, flops = numbers.tolist()  # one read from the device
        metrics |= {"loss": loss, "num_tokens": int(num_tokens), "perf/flops": flops}
        return metrics | {"time/training": time.perf_counter() - start}

    # ---- 4.6 Algorithm 1 ----
    def train(self):
        """Sample -> reward -> filter -> buffer, then optimizer steps over the rollout; log, eval, save."""
        args, state = self.args, self.state
        G, accumulation = args.num_generations, args.gradient_accumulation_steps
        groups_per_rollout = args.batch_size * accumulation * args.steps_per_generation * self.world.size  # all ranks
        check_rows(self, groups_per_rollout)  # guards.py: a training split too small for one step, said as that
        steps = args.num_iterations * args.epoch * len(self.train_dataset) // (args.batch_size * accumulation)
        self.global_steps = min(steps, args.max_steps or steps)  # an upper bound: dynamic sampling skips groups
        if state.update_steps >= self.global_steps and not state.evaluation_pending:  # a resume at or past max_steps
            return tqdm.write(f"already at step {state.update_steps} of {self.global_steps}: nothing to train")
        report_to = args.report_to if self.world.is_main else "none"  # rank 0 alone reports
        self.tracker = make_tracker(report_to, args.output_dir, dataclasses.asdict(args))
        start_steps, self.empty_rounds, calls = state.update_steps, 0, self.prompt_batches()  # this epoch's calls
        metrics, state.metrics = defaultdict(list, state.metrics), {}  # this step's (a stop's resume: so far)
        bar = dict(total=self.global_steps, initial=state.update_steps, desc="DAPO", unit="step", dynamic_ncols=True)
        bar = tqdm(**bar, disable=not self.world.is_main)
        with bar as self.progress, deferred_interrupts(self), contextlib.closing(self.tracker):
            if not self.resumed or state.evaluation_pending:  # step 0's evaluation, or the one a stop cut short
                self.end_step(metrics)
                metrics = defaultdict(list)
            step_start = time.perf_counter()  # time/step: from the step's first sampling round to its optimizer step
            while state.update_steps < self.global_steps:
                if state.rollout is None:
                    # 1. Sample G responses per prompt, score them, drop the groups without signal (dynamic
                    #    sampling), and buffer the rest until the rollout's groups are there.
                    call = next(calls, None)  # the prompt batches the rollout still needs, sampled at once
                    if call is None:  # the epoch's end: the seed's buffer lives one epoch, a partial step is dropped
                        state.epoch, state.batches_done, state.rounds = state.epoch + 1, 0, 0
                        state.buffer = []
                        if state.epoch >= args.epoch:
                            break
                        calls = self.prompt_batches()
                        continue
                    mine = distributed.step_slice(call, self.world.rank, self.world.size)  # this rank's batches
                    kept, round_metrics = self.sample_round(mine)
                    for key, values in round_metrics.items():
                        metrics[key] += values
                    state.buffer += kept
                    state.rounds += len(call)
                    self.empty_rounds = 0 if self.world.any(bool(kept)) else self.empty_rounds + len(call)  # all ranks
                    taken = self.world.take_rollout(state.buffer, groups_per_rollout, args.steps_per_generation)
                    if taken is None:  # not enough groups yet
                        check_rounds(self, metrics)  # guards.py: a run that keeps no group ends in one line
                        stop_if_requested(self, metrics)  # checkpoints.py: Ctrl-C or SIGTERM between sampling rounds
                        continue
                    # 2. The rollout: the first valid groups in the sampling order (one process: the buffer's
                    #    first), as micro-batches of batch_size groups, with pi_old's and pi_ref's log-probs.
                    start = time.perf_counter()
                    rollout, state.buffer = taken  # under torchrun: this rank's part of each step
                    state.rollout = self.make_micro_batches(rollout)
                    state.updates_done = 0
                    metrics["time/old_ref_log_probs"].append(time.perf_counter() - start)
                    metrics["perf/flops"].append(log_prob_flops(self.flop_shape, state.rollout))  # pi_old's, pi_ref's
                    metrics["num_gen_batches"].append(state.rounds)
                    state.rounds = 0
                    stop_if_requested(self, metrics)  # a stop while sampling: no step begun, the rollout kept

                # 3. One optimizer step: gradient accumulation over its slice of the rollout's micro-batches
                #    (num_iterations passes over steps_per_generation slices).
                step_in_rollout = state.updates_done % args.steps_per_generation
                micro_batches = distributed.step_slice(state.rollout, step_in_rollout, args.steps_per_generation)
                units = (args.loss_agg_mode, G, args.max_generate_length)
                normaliser = sum(loss_normaliser(m.action_mask, *units) for m in micro_batches)
                normaliser = self.world.sum(normaliser)  # the whole step's units, over every rank
                self.model.train()
                for inputs in micro_batches:
                    for key, value in self.train_step(self.model, inputs, normaliser).items():
                        metrics[key].append(value)
                self.world.reduce_gradients(self.model)  # summed over ranks: the one-process gradient
                max_norm = args.max_grad_norm if args.max_grad_norm > 0 else math.inf
                metrics["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)))
                finite = {"loss": sum(metrics["loss"]), "gradient norm": metrics["grad_norm"][-1]}
                check_finite(args, state.update_steps + 1, finite)  # guards.py: divergence, before the step
                metrics["learning_rate"].append(self.optimizer.param_groups[0]["lr"])
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
                state.update_steps += 1
                check_weights(self)  # before any checkpoint takes them
                state.updates_done += 1
                if state.updates_done == args.num_iterations * args.steps_per_generation:
                    state.rollout = None

                # 4. Step end: evaluate, log, save, stop.
                metrics["time/step"].append(time.perf_counter() - step_start)
                metrics = self.world.gather_step(metrics)  # every rank's numbers, in rank order
                for loss in metrics["loss"]:  # the seed's file: a line per micro-step, numbered by the steps before
                    self.append_line("training_losses.txt", f"{state.update_steps - 1},{loss:.8f}")
                self.end_step(metrics)
                metrics, step_start = defaultdict(list), time.perf_counter()
        check_data_ran_out(self, start_steps)  # guards.py: none or fewer steps than the bar's bound, said so

    def prompt_batches(self):
        """This epoch's sampling calls, each the prompt batches the rollout still needs over all ranks
        (World.rounds_to_sample), in the epoch's seeded order (a resumed run skips the batches it had consumed).
        Every rank walks the same calls; each samples its own part of a call (train)."""
        args, state = self.args, self.state
        per_rank = args.batch_size * args.gradient_accumulation_steps * args.steps_per_generation
        order = torch.Generator().manual_seed(args.seed + state.epoch)
        loader = DataLoader(self.train_dataset, batch_size=args.batch_size, shuffle=True, generator=order)
        batches = numbered(loader)[state.batches_done :]
        while batches:
            held, sizes = self.world.sum(len(state.buffer)), (args.batch_size, args.generation_batch_size)
            count = self.world.rounds_to_sample(held, per_rank, *sizes)
            if args.max_num_gen_batches:  # the rounds check_rounds allows, no more
                count = min(count, args.max_num_gen_batches - state.rounds)
            call, batches = batches[:count], batches[count:]
            state.batches_done += len(call)
            yield call

    def end_step(self, metrics):
        """A step's end (step 0: the evaluation before training): evaluate when due, log, save when due, stop if
        asked. A stop during the evaluation ends it before its next batch (EvaluationStopped, torch's RNG rewound):
        the checkpoint keeps the step's metrics, and the resumed run evaluates and logs the step first, as this
        run would have. metrics: the step's, gathered from every rank."""
        step = self.state.update_steps
        self.state.evaluation_pending = step % self.args.eval_steps == 0
        if self.state.evaluation_pending:
            try:
                self.evaluate_and_log()
            except EvaluationStopped:  # on every rank: they asked together
                stop_if_requested(self, metrics)
        self.state.evaluation_pending = False
        if metrics:  # a step's (none before training)
            self.log_step(metrics)
        saved = save_run_checkpoint(self) if metrics and step % self.args.save_steps == 0 else None
        stop_if_requested(self, {}, saved)  # a stop during the evaluation's last batch or the write: that checkpoint

    # ---- 4.7 logging ----
    def append_line(self, filename, line):
        if self.world.is_main:  # one writer
            append_log(self.args.output_dir, filename, line)

    def log_step(self, metrics):
        """This optimizer step's record: to metrics.jsonl, the tracker and the progress bar."""
        record = step_record(self.state.update_steps, metrics)
        record |= {key: self.world.sum(getattr(self.state, key)) for key in ("skipped_groups", "truncated_prompts")}
        record |= self.eval_record if self.state.update_steps % self.args.eval_steps == 0 else {}  # evaluated now
        record |= perf_metrics(record, self.roof.peak, self.world.size)  # perf/throughput, perf/mfu, ... (flops.py)
        if self.args.device.startswith("cuda"):  # this step's peak: the counter starts again after each record
            record["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.args.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.args.device)
        keys = [*self.eval_record, *(self.history[-1] if self.history else ())]  # the run's keys in every record:
        record = dict.fromkeys(keys) | record  # None where this step did not evaluate, sample, ...
        self.history.append(record)
        self.append_line("metrics.jsonl", json.dumps(record, ensure_ascii=False))
        self.tracker.log(record)
        self.progress.set_postfix(progress_postfix(record, self.last_accuracy), refresh=False)
        self.progress.update(1)

    def evaluate_and_log(self):
        """Evaluate; append to accuracy_losses.txt (the seed's: strict), evaluations.jsonl (every metric of
        evaluation.py) and samples.jsonl; log to the tracker (after step 0: in the step's record); redraw curves.png."""
        args, step = self.args, self.state.update_steps
        self.last_accuracy, examples = self.evaluate(args.eval_samples, args.eval_batch_size, return_examples=True)
        lenient = self.eval_record["eval/accuracy_lenient"]
        if self.world.is_main:
            tqdm.write(f"step {step}: accuracy {self.last_accuracy:.2f} (lenient {lenient:.2f})")
        self.append_line("accuracy_losses.txt", f"{step},{self.last_accuracy:.2f}")
        self.append_line("evaluations.jsonl", json.dumps({"step": step, **self.eval_record}))
        for example in examples:
            self.append_line("samples.jsonl", json.dumps({"step": step, **example}, ensure_ascii=False))
        if step == 0:  # later evaluations go into their step's record (log_step)
            self.tracker.log({"step": step, **self.eval_record})
        if self.world.is_main:
            redraw_curves(args.output_dir)  # a failure is a warning: a picture must never end a run
        return self.last_accuracy

    # ---- 4.8 evaluation ----
    def respond(self, prompts, k=1):
        """k responses to each prompt, in one sample() call: their texts, token counts (EOS included) and whether
        each hit max_generate_length without an EOS, k rows per prompt."""
        input_ids, attention_mask = (x.repeat_interleave(k, dim=0) for x in self.encode_prompts(prompts))  # [B*k, P]
        response_ids = self.sample(input_ids, attention_mask)[0][:, input_ids.size(1) :]  # [B*k, T]: all start there
        lengths = response_mask(response_ids, self.eos_token_ids, response_ids.size(1)).sum(dim=1)  # [B*k]
        truncated = is_truncated(response_ids, lengths, self.eos_token_ids).tolist()
        return self.tokenizer.batch_decode(response_ids, skip_special_tokens=True), lengths.tolist(), truncated

    def evaluate(self, num_samples=100, batch_size=20, return_examples=False):
        """The seed's accuracy (strict) of sampled answers to num_samples random test problems (a small eval set: all);
        self.eval_record: every metric (evaluate_model). With return_examples, also the first problems' records."""
        metrics, _, examples = evaluate_model(self, num_samples, batch_size, LOGGED_EXAMPLES if return_examples else 0)
        self.eval_record = logged_metrics(metrics)
        return (metrics["accuracy_strict"], examples) if return_examples else metrics["accuracy_strict"]

    def save_model(self):
        state = self.world.full_model_state(self.model)  # --fsdp: gathered from every rank; else None
        if self.world.is_main:  # atomically: weights and tokenizer together (LoRA: the adapters, merge_lora's model)
            args, step = self.args, self.state.update_steps  # step: whether a checkpoint holds these weights
            save_final_model(self.model, self.tokenizer, args.output_dir, state, args.merge_lora, step)
        self.world.from_rank_0(None)  # the ranks leave together: none tears the process group down mid-write


# ============================================================
# 5. Entry point
# ============================================================
def build_args(preset, overrides):
    """DapoArguments from the preset (presets.py: seed, the paper's ladder, paper, the GRPO family) and the command-line
    overrides (overrides win)."""
    max_generate_length = overrides.get("max_generate_length", DapoArguments.max_generate_length)
    return DapoArguments(**{**preset_fields(preset, max_generate_length), **overrides})


def build_trainer(args, train=True):
    """The seed's run: policy and tokenizer from model_path, rows from data_path, the rewards of reward_funcs."""
    tokenizer = load_tokenizer(args.model_path)
    read = dict(columns=(args.question_column, args.answer_column), answer_format=args.answer_format)
    read["test_size"] = args.test_size  # rows of train held out as test when the data set has no test split
    train_dataset = GSM8KDataset(args.data_path, tokenizer, "train", **read) if train else None  # --eval_only: none
    eval_dataset = GSM8KDataset(args.data_path, tokenizer, "test", **read)
    reward_funcs = reward_functions(args, reward_func, trial=eval_dataset)  # each tried on two rows before loading
    return DapoTrainer(args.model_path, reward_funcs, args, train_dataset, eval_dataset, tokenizer)


def run(args, checkpoint=None, on_start=None):
    """The seed's entry point: a trainer built from args (resumed from a checkpoint), trained, its model saved.
    on_start(trainer): once it has loaded, before it samples (launch writes output_dir/dapo_args.json)."""
    trainer = build_trainer(args)
    if checkpoint:
        resume_run(trainer, checkpoint)
    if on_start:
        on_start(trainer)
    trainer.train()
    trainer.save_model()
    return trainer


def main(argv=None):
    """python train.py [--demo | --resume=CHECKPOINT | --eval_only | --plot=DIR | --check_rewards] [--preset=NAME]
    [--field=value ...]: the modes, the output folder's lock and the summary are dapo_utils/launch.py's."""
    return launch.main(argv, DapoArguments, build_args, build_trainer, run, reward_func)


if __name__ == "__main__":
    main()
    distributed.end_of_run()  # under torchrun: the process ends here, without the interpreter's shutdown
