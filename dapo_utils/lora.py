"""LoRA for DapoArguments.lora_r > 0, through Hugging Face's peft (pip install -r requirements/lora.txt).

Each targeted linear layer keeps its weight W frozen and learns a low-rank update (Hu et al. 2021, Eq. 3):

    h = W x + (alpha / r) * B A x,      A [r, in] (random), B [out, r] (zero at the start: the policy starts as W)

What the trainer gets from this room (imported only when lora_r > 0, or when an adapter folder is loaded):
  - add_adapters: the policy as a peft model whose adapters alone require gradients (and so alone enter Adam);
    on CUDA with bf16 the frozen base is kept in bf16 (2 bytes a parameter), the adapters in float32.
  - pi_ref needs no copy: AdaptersOff runs the same model under peft's `disable_adapter()`, which is the base.
  - merged_weights: W + (alpha / r) B A under the base checkpoint's names, computed beside the model (which keeps
    W and its adapters): what vLLM loads after each optimizer step and what --merge_lora writes.
  - checkpoints and the final output_dir are adapter folders (adapter_config.json, adapter_model.safetensors):
    load_adapters resumes one; load_merged turns one into a plain model for --eval_only and --compare.
"""

import os

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file in an adapter folder
MERGED_DIR = "merged"  # output_dir/merged: the base with the adapters merged in (--merge_lora=true)


def target_modules(value):
    """lora_target_modules as peft takes it: "all-linear" (every linear layer but the output head), or a list of
    module names from "q_proj,v_proj"."""
    return value if value == "all-linear" else [name.strip() for name in value.split(",") if name.strip()]


def unmatched_targets(model, value):
    """The names of lora_target_modules that match no module of model (peft's rule: the module's name, or its
    last dotted parts); [] for "all-linear". model may live on the meta device (cli.check_before_loading)."""
    names = [name for name, _ in model.named_modules()]
    wanted = target_modules(value)
    return (
        [] if wanted == "all-linear" else [t for t in wanted if not any(n == t or n.endswith("." + t) for n in names)]
    )


def model_skeleton(path):
    """model_path's architecture on the meta device (its config alone, no weights read): to check names early."""
    folder, gguf = (os.path.dirname(path) or ".", os.path.basename(path)) if path.endswith(".gguf") else (path, None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=gguf))


def add_adapters(model, args):
    """The policy with fresh LoRA adapters (args.lora_r, lora_alpha, lora_dropout, lora_target_modules); every
    base parameter frozen. The adapter folder names the base by its absolute path, so that --eval_only can load
    it from anywhere."""
    unmatched = unmatched_targets(model, args.lora_target_modules)
    if unmatched:
        raise ValueError(f"lora_target_modules {unmatched} match no module of the model: see its named_modules()")
    if args.bf16 and args.device.startswith("cuda"):  # frozen and only run under autocast: bf16 is enough
        model = model.to(torch.bfloat16)
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
        target_modules=target_modules(args.lora_target_modules),
        base_model_name_or_path=os.path.abspath(args.model_path),
    )  # fmt: skip
    return get_peft_model(model, config, autocast_adapter_dtype=True)  # adapters in float32


class AdaptersOff(torch.nn.Module):
    """pi_ref under LoRA: the policy's forward with its adapters disabled (peft's disable_adapter), which computes
    the base model's; no second copy of the weights."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):  # the output layer, which LoRA's "all-linear" leaves alone
        return self.policy.get_output_embeddings()


def merged_weights(model, merge=True):
    """(name, tensor) of every parameter of the base model under its checkpoint name, each targeted weight with
    its adapter merged: W + (alpha / r) B A (peft's get_delta_weight), in float32. Computed aside: the model keeps
    W and its adapters. A tied lm_head shares the embedding, which comes once (as named_parameters gives it).
    Each merged weight is made when its turn comes: one [out, in] float32 tensor at a time as vLLM takes them,
    not all deltas at once (5.2 GB at Qwen2.5-1.5B's shape with all-linear targets).
    merge=False: the base weights W as they are."""
    base = model.get_base_model()
    layers = {f"{name}.weight": m for name, m in base.named_modules() if merge and isinstance(m, LoraLayer)}
    for name, param in base.named_parameters():
        if "lora_" not in name:
            name = name.replace(".base_layer.", ".")
            layer = layers.get(name)
            yield name, param.detach() if layer is None else layer.get_delta_weight(ADAPTER).float().add_(param)


def save_merged(model, tokenizer, folder):
    """A plain model in folder (config, weights, tokenizer) that from_pretrained loads alone: base + adapters."""
    model.get_base_model().save_pretrained(folder, state_dict=dict(merged_weights(model)))
    tokenizer.save_pretrained(folder)


def load_adapters(model, folder):
    """A checkpoint's adapters into the peft model (the base is model_path's, loaded as it was)."""
    set_peft_model_state_dict(model, load_file(os.path.join(folder, ADAPTER_WEIGHTS)))


def load_merged(folder, load_base):
    """An adapter folder as a plain float32 model (--eval_only, --compare, or a new run's start): its base (adapter_config.json's
    base_model_name_or_path, loaded by load_base) with the adapters merged in."""
    base = load_base(PeftConfig.from_pretrained(folder).base_model_name_or_path)
    return PeftModel.from_pretrained(base, folder).merge_and_unload().requires_grad_(True)  # a plain model again
