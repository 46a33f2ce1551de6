"""A tiny, fully offline world for `python train.py --demo` and the tests.

It stands in for the three things the real run downloads:

- the data set `swulling/gsm8k_chinese`  -> synthetic Chinese addition/subtraction word problems,
- the tokenizer of Qwen2.5-Instruct      -> a ~120-token byte-level BPE trained on those problems,
- the Qwen2.5-Instruct weights           -> a random 2-layer Qwen2 with hidden size 64.

Everything is saved with the standard Hugging Face writers, so train.py loads it with exactly the
code it uses for the real thing: `datasets.load_dataset(data_dir)`,
`AutoTokenizer.from_pretrained(model_dir)` and `AutoModelForCausalLM.from_pretrained(model_dir)`.

Why the tokenizer copies Qwen2's byte-level pipeline: because the model folder's config.json says
`model_type: qwen2`, transformers 5 AutoTokenizer loads the folder as `Qwen2Tokenizer` whatever
`tokenizer_class` tokenizer_config.json names (qwen2 is in transformers' list
MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS). Qwen2Tokenizer keeps only the vocab and merges of
tokenizer.json and rebuilds the rest (NFC, Qwen2's split regex, ByteLevel), so a character-level
vocabulary would silently lose every Chinese character. Training with that same pipeline makes
the reloaded tokenizer identical to the trained one, whichever class ends up loading it.
"""

import os
import random
import re
import shutil

import datasets
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from checkpoints import LOG_FILES, find_checkpoints

VOCAB_SIZE = 120
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ChatML, as in Qwen2.5
# The answer format tags are single but ordinary tokens: the reward functions read text decoded
# with skip_special_tokens=True, which would delete them if they were special.
FORMAT_TOKENS = ["<think>\n", "</think>\n", "<answer>\n", "</answer>\n"]
# Qwen2.5-Instruct's template without tool calls and without the default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMES = [("小明", "Xiao Ming"), ("小红", "Xiao Hong"), ("小华", "Xiao Hua"), ("小丽", "Xiao Li")]
ITEMS = [  # (noun, measure word, English noun)
    ("苹果", "个", "apples"),
    ("书", "本", "books"),
    ("铅笔", "支", "pencils"),
    ("糖", "颗", "candies"),
]
# (operator, Chinese template, English template); {u} is the measure word.
TEMPLATES = [
    (
        "+",
        "{name}有{a}{u}{item}，又买了{b}{u}，现在一共有几{u}{item}？",
        "{en_name} has {a} {en_item} and buys {b} more. How many {en_item} does {en_name} have now?",
    ),
    (
        "+",
        "桌子上有{a}{u}{item}，{name}又放上了{b}{u}，桌子上一共有几{u}{item}？",
        "There are {a} {en_item} on the table. {en_name} puts {b} more on it. How many {en_item} are on the table?",
    ),
    (
        "-",
        "{name}有{a}{u}{item}，送给同学{b}{u}，还剩几{u}{item}？",
        "{en_name} has {a} {en_item} and gives {b} to a classmate. How many {en_item} are left?",
    ),
    (
        "-",
        "{name}有{a}{u}{item}，弄丢了{b}{u}，还剩几{u}{item}？",
        "{en_name} has {a} {en_item} and loses {b}. How many {en_item} are left?",
    ),
]


def make_problem(rng: random.Random) -> dict:
    """One word problem, as a row with the columns of swulling/gsm8k_chinese."""
    op, zh, en = rng.choice(TEMPLATES)
    (name, en_name), (item, u, en_item) = rng.choice(NAMES), rng.choice(ITEMS)
    if op == "+":
        a, b = rng.randint(1, 10), rng.randint(1, 10)
        c = a + b
    else:  # b <= a, so that the answer is never negative
        a = rng.randint(1, 20)
        b = rng.randint(1, a)
        c = a - b
    words = dict(name=name, en_name=en_name, item=item, u=u, en_item=en_item, a=a, b=b)
    return {
        "question": en.format(**words),
        # GSM8K style: the <<...>> calculator annotation, then the final answer after ####.
        "answer": f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}\n#### {c}",
        "question_zh-cn": zh.format(**words),
        "answer_only": c,
    }


def make_problems(n: int, seed: int) -> list[dict]:
    """n word problems, the same ones for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def make_splits(num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    # Different seeds, so that test is not a prefix of train.
    return {"train": make_problems(num_train, seed), "test": make_problems(num_test, seed + 1)}


def write_dataset(data_dir: str, num_train: int, num_test: int, seed: int = 0) -> str:
    """Write train/test parquet files laid out like the Hub repo, for load_dataset(data_dir)."""
    os.makedirs(os.path.join(data_dir, "data"), exist_ok=True)
    for split, rows in make_splits(num_train, num_test, seed).items():
        path = os.path.join(data_dir, "data", f"{split}-00000-of-00001.parquet")
        datasets.Dataset.from_list(rows).to_parquet(path)
    return data_dir


def chatml_prompt(system_prompt: str, question: str) -> str:
    """What CHAT_TEMPLATE renders for a system + user turn with add_generation_prompt=True."""
    return (
        f"<|im_start|>system\n{system_prompt}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def ideal_response(row: dict) -> str:
    """A perfectly formatted completion; the reasoning is the calculator annotation, e.g. 3+5=8."""
    calculation = re.search(r"<<(.+?)>>", row["answer"]).group(1)
    return f"<think>\n{calculation}\n</think>\n<answer>\n{row['answer_only']}\n</answer>\n"


def build_tokenizer(texts: list[str]) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE with Qwen2's normalizer and pre-tokenizer on texts."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # The initial alphabet is only the bytes seen in texts, not all 256, which keeps the vocabulary
    # tiny; text made of other bytes cannot be encoded, so texts must cover everything the demo
    # feeds the model.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(FORMAT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    # Added tokens are cut out of the text before BPE sees it, but the trainer does not know that:
    # cut them out here too, or the few merges get spent on pieces like "<|" and "think".
    added = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + FORMAT_TOKENS))
    pieces = [piece for text in texts for piece in added.split(text) if piece]
    tokenizer.train_from_iterator(pieces, trainer)

    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",  # ends an assistant turn, as in Qwen2.5-Instruct
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],  # as in Qwen2.5's config
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    # Added after training so they get fresh ids at the end instead of clashing with the BPE vocab.
    hf_tokenizer.add_tokens([transformers.AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    return hf_tokenizer


def build_tiny_model(tokenizer: transformers.PreTrainedTokenizerBase, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """A random float32 Qwen2 small enough to train on a CPU."""
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: vLLM's CPU attention kernels run it (--demo --use_vllm=true)
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=endoftext,  # Qwen2.5 has no BOS token; its config names <|endoftext|>
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # Seed a forked RNG so that building the model leaves the caller's random state alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    # As in Qwen2.5-Instruct: generation stops at the end of the turn or of the text.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def warm_up(model, tokenizer, texts, steps, seed=0, lr=3e-3, batch_size=32):
    """A short supervised warm-up on (prompt, ideal response) pairs, loss on the response only.

    RL then starts, as from Qwen2.5-Instruct, from a model that knows the answer format and is
    sometimes right. From random weights it is almost never right, and the paper's dynamic sampling
    (keep a group only if 0 < #correct < G) would skip every group.
    """
    examples = []
    for prompt, response in texts:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids + response_ids, [-100] * len(prompt_ids) + response_ids))
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        for _ in range(steps):
            batch = rng.sample(examples, min(batch_size, len(examples)))
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
            lengths = torch.tensor([len(ids) for ids, _ in batch])
            attention_mask = (torch.arange(width)[None] < lengths[:, None]).long()  # right padding
            model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    return model


def build_tiny_world(
    root: str, system_prompt: str, num_train: int = 200, num_test: int = 50, seed: int = 0, warm_up_steps: int = 0
) -> tuple[str, str]:
    """Write the data set to root/gsm8k_tiny and the tokenizer + model to root/tiny-qwen2.

    warm_up_steps > 0 first teaches the model the answer format on the training problems (warm_up).
    """
    data_dir = write_dataset(os.path.join(root, "gsm8k_tiny"), num_train, num_test, seed)
    splits = make_splits(num_train, num_test, seed)
    rows = splits["train"] + splits["test"]
    # Every prompt train.py will build, plus a well-formatted answer, so that the tokenizer covers
    # all characters and the ideal completion is learnable.
    texts = [chatml_prompt(system_prompt, row["question_zh-cn"]) + ideal_response(row) + "<|im_end|>\n" for row in rows]
    tokenizer = build_tokenizer(texts)
    model = build_tiny_model(tokenizer, seed)
    if warm_up_steps:
        pairs = [
            (chatml_prompt(system_prompt, row["question_zh-cn"]), ideal_response(row) + "<|im_end|>")
            for row in splits["train"]
        ]
        warm_up(model, tokenizer, pairs, warm_up_steps, seed)

    model_dir = os.path.join(root, "tiny-qwen2")
    tokenizer.save_pretrained(model_dir)
    model.save_pretrained(model_dir)

    # Reload the way train.py does: AutoTokenizer may pick another class than the one we saved
    # (see the module docstring), and a wrong one drops characters without any error.
    reloaded = transformers.AutoTokenizer.from_pretrained(model_dir)
    for row in rows:
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": row["question_zh-cn"]},
        ]
        text = reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text += ideal_response(row)
        decoded = reloaded.decode(reloaded.encode(text, add_special_tokens=False))
        if decoded != text:
            raise RuntimeError(
                f"the tokenizer in {model_dir}, reloaded as {type(reloaded).__name__}, "
                f"does not round-trip {text!r}: got {decoded!r}"
            )
    return model_dir, data_dir


# ============================================================
# The demo: python train.py --demo
# ============================================================
DEMO_DIR = os.path.join(".", "output", "demo")
# The tiny world learns in about a minute on 2 CPU cores with these settings; anything given on the
# command line still wins (e.g. --max_steps=50, or --preset paper --filter_metric=reward).
DEMO_ARGS = dict(
    model_path=os.path.join(DEMO_DIR, "tiny-qwen2"),
    data_path=os.path.join(DEMO_DIR, "gsm8k_tiny"),
    output_dir=DEMO_DIR,
    device="cpu",
    lr=1e-3,
    num_generations=8,
    max_generate_length=32,
    epoch=10,
    max_steps=300,
    eval_steps=50,
    eval_samples=20,
    eval_batch_size=20,
    save_steps=100,
)
DEMO_WARM_UP_STEPS = 50  # supervised steps before RL: the answer format, rarely the answer
# --demo --preset paper. The paper's filter keeps a group only when some but not all of its
# responses are correct, so RL must start from a model that is sometimes right: 300 warm-up steps
# make it right about 1 time in 5 on the training problems (50 steps: 1 in 20, and most groups
# are skipped). At lr 1e-3 the surviving groups pull the format apart (measured: total reward
# 1.199 -> 0.760); at 3e-4 it learns, slower, hence 600 steps.
PAPER_DEMO_ARGS = dict(lr=3e-4, max_steps=600, epoch=20)
PAPER_DEMO_WARM_UP_STEPS = 300


def demo_settings(preset: str) -> tuple[dict, int]:
    """(DapoArguments overrides, warm-up steps) of the demo for a --preset."""
    if preset == "paper":
        return {**DEMO_ARGS, **PAPER_DEMO_ARGS}, PAPER_DEMO_WARM_UP_STEPS
    return dict(DEMO_ARGS), DEMO_WARM_UP_STEPS


def demo_summary(history, output_dir):
    """Mean total and correctness reward over the first and last 50 steps (or fifth of the run), and
    the first and last test accuracy."""
    window = max(1, min(50, len(history) // 5))

    def first_and_last(key):  # mean of a metric over the first and the last `window` steps
        values = [record[key] for record in history if key in record]
        return sum(values[:window]) / window, sum(values[-window:]) / window

    start, end = first_and_last("reward")
    correct_start, correct_end = first_and_last("rewards/correctness_reward/mean")
    path = os.path.join(output_dir, "accuracy_losses.txt")
    with open(path, encoding="utf-8") as f:
        accuracies = [line.strip().split(",") for line in f if line.strip()]
    return (
        f"\ndemo summary after {history[-1]['step']} steps ({history[-1]['skipped_groups']} groups skipped):\n"
        f"  mean total reward  first {window} steps {start:.3f}  ->  last {window} steps {end:.3f}  ({end - start:+.3f})\n"
        f"  correctness reward first {window} steps {correct_start:.3f}  ->  last {window} steps {correct_end:.3f}  ({correct_end - correct_start:+.3f})\n"
        f"  accuracy           step {accuracies[0][0]} {float(accuracies[0][1]):.2f}  ->  step {accuracies[-1][0]} {float(accuracies[-1][1]):.2f}\n"
        f"  logs: {output_dir}/training_losses.txt, accuracy_losses.txt, metrics.jsonl"
    )


def demo_world(output_dir, system_prompt, warm_up_steps):
    """A fresh demo in output_dir: clear its logs and checkpoints (an earlier run's would mix with this one's),
    then build the world there. Returns (model_dir, data_dir)."""
    for name in [*LOG_FILES, *(f"checkpoint_{step}" for step in find_checkpoints(output_dir))]:
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.path.exists(path) and os.remove(path)
    return build_tiny_world(output_dir, system_prompt, warm_up_steps=warm_up_steps)
