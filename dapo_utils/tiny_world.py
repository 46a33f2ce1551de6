"""A tiny, fully offline world for `python train.py --demo` and the tests.

It stands in for the three things the real run downloads:

- the data set `swulling/gsm8k_chinese`  -> synthetic Chinese addition/subtraction word problems,
- the tokenizer of Qwen2.5-Instruct      -> a ~280-token byte-level BPE trained on those problems,
- the Qwen2.5-Instruct weights           -> a 2-layer Qwen2 (hidden 64, 2 heads of 32) given a
                                            short supervised warm-up.

The demo's design, so that held-out accuracy is the headline (docs/demo.md):
- Skill: 50 small facts (a + b, a, b in 1..5, and the same facts read backwards as a - b). The test
  split holds out *phrasings*: a quarter of the (template, name, item) combinations appear only in
  test, so no test question string is in train (make_splits; tested), while every fact is in both.
- Warm-up, noisy on purpose: 300 clean supervised steps teach the format and the facts, then 150
  steps on targets of which 75% are off by 1 to 3 (lr falling to 0), a stand-in for an instruct
  model that is sometimes right: measured on the test split, its greedy answer is right on half the
  problems (0.50) but a sample at T 0.9 only ~1 time in 4 (0.22), on train and test alike. RL with
  the real rewards then sharpens the policy toward the right answer (and firms up the facts: greedy
  0.70 after 120 steps); since the answer depends on the numbers, not the phrasing, this carries to
  the held-out phrasings, and `--lr=0` (same sampling, no learning) stays flat.
- Tokenizer: ~280 tokens, so that a prompt is ~31 tokens (Chinese phrases are single tokens), which
  makes the warm-up take seconds and each RL step cheap. Model: head size 32, which vLLM's CPU
  attention kernels support (`--demo --use_vllm=true`).
- RL: 160 steps of 8 prompts (4 per micro-batch, one sampling call of 64 rows) x G 8, 20-token
  responses, lr 3e-4 with the gradient norm clipped to 1 (at 1e-3 the policy collapsed after ~20
  steps), on one torch thread (the thread count changes a CPU's sums, so the samples); every 20 steps one
  evaluation of all 200 test problems in one sampling call.

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

import contextlib
import math
import os
import random
import re
import shlex
import shutil

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from dapo_utils.checkpoints import find_checkpoints
from dapo_utils.curves import read_accuracies, unevaluated_steps
from dapo_utils.options import shown_path
from dapo_utils.run_dir import LOCK_FILE, claim_output_dir
from dapo_utils.writes import writing

DEMO_MARKER = "demo_world.txt"  # in the output_dir the demo made: the only kind of folder a new demo clears
VOCAB_SIZE = 300  # the BPE stops at ~280: a prompt is ~31 tokens, Chinese phrases are single tokens
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


# The skill: small facts, a + b with a, b in 1..5 and a - b = c with b in 1..5, c in 0..4 (the same
# facts read backwards): 50 (operator, a, b) triples, all of them in both splits. Answers are 0..10.
FACTS = [("+", a, b) for a in range(1, 6) for b in range(1, 6)] + [
    ("-", b + c, b) for b in range(1, 6) for c in range(5)
]
# Held out: the phrasing. A phrasing is a (template, name, item) combination; a seeded quarter of them
# (8 of the 32 per operator) is used only by the test split, so that no test question is in train.
PHRASINGS = [(t, n, i) for t in range(len(TEMPLATES)) for n in range(len(NAMES)) for i in range(len(ITEMS))]


def split_phrasings(seed: int = 0) -> tuple[list, list]:
    """(train phrasings, test phrasings): per operator, a seeded quarter is held out for test."""
    train, test = [], []
    for op in ("+", "-"):
        phrasings = [p for p in PHRASINGS if TEMPLATES[p[0]][0] == op]
        random.Random(f"phrasings-{seed}-{op}").shuffle(phrasings)
        cut = len(phrasings) // 4
        test += phrasings[:cut]
        train += phrasings[cut:]
    return sorted(train), sorted(test)


def make_row(fact: tuple, phrasing: tuple) -> dict:
    """The word problem of fact (op, a, b) in phrasing (template, name, item), as a row with the
    columns of swulling/gsm8k_chinese."""
    op, a, b = fact
    t, n, i = phrasing
    _, zh, en = TEMPLATES[t]
    (name, en_name), (item, u, en_item) = NAMES[n], ITEMS[i]
    c = a + b if op == "+" else a - b
    words = dict(name=name, en_name=en_name, item=item, u=u, en_item=en_item, a=a, b=b)
    return {
        "question": en.format(**words),
        # GSM8K style: the <<...>> calculator annotation, then the final answer after ####.
        "answer": f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}\n#### {c}",
        "question_zh-cn": zh.format(**words),
        "answer_only": c,
    }


def make_problem(rng: random.Random, phrasings=PHRASINGS) -> dict:
    """One random word problem in one of phrasings."""
    fact = rng.choice(FACTS)
    return make_row(fact, rng.choice([p for p in phrasings if TEMPLATES[p[0]][0] == fact[0]]))


def make_problems(n: int, seed: int, phrasings=PHRASINGS) -> list[dict]:
    """n word problems in phrasings, the same ones for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, phrasings) for _ in range(n)]


def make_splits(num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """Train and test problems in disjoint phrasings: the same facts, no test question in train.
    Test questions are distinct (drawn without replacement from the 400 held-out questions)."""
    train_phrasings, test_phrasings = split_phrasings(seed)
    held_out = [make_row(f, p) for f in FACTS for p in test_phrasings if TEMPLATES[p[0]][0] == f[0]]
    test = random.Random(seed + 1).sample(held_out, min(num_test, len(held_out)))
    return {"train": make_problems(num_train, seed, train_phrasings), "test": test}


def write_dataset(data_dir: str, num_train: int, num_test: int, seed: int = 0) -> str:
    """Write train/test parquet files laid out like the Hub repo, for load_dataset(data_dir)."""
    import datasets  # here, not at the top: the rest of this module works without it (gpu_check.sh's parts)

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


def ideal_response(row: dict, result=None) -> str:
    """A perfectly formatted completion; the reasoning is the calculator annotation, e.g. 3+5=8. result: another
    number to state as the result, in the calculation and in <answer> (the noisy warm-up's wrong answers)."""
    calculation = re.search(r"<<(.+?)>>", row["answer"]).group(1)
    result = row["answer_only"] if result is None else result
    calculation = calculation[: calculation.rindex("=") + 1] + str(result)
    return f"<think>\n{calculation}\n</think>\n<answer>\n{result}\n</answer>\n"


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE with Qwen2's normalizer and pre-tokenizer on texts (a smaller vocab_size keeps
    more texts apart in length: phrases stay several tokens)."""
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
        vocab_size=vocab_size - len(FORMAT_TOKENS),
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


MODEL_SHAPE = dict(  # head size 64 / 2 = 32: vLLM's CPU attention kernels run it (--demo --use_vllm=true)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)


def build_tiny_model(tokenizer: transformers.PreTrainedTokenizerBase, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """A random float32 Qwen2 small enough to train on a CPU."""
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        **MODEL_SHAPE,
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


DEMO_NUM_TRAIN, DEMO_NUM_TEST = 1000, 200  # problems in the demo's splits
WARM_UP_LR, WARM_UP_BATCH = 3e-3, 64
WARM_UP_NOISE = 0.75  # in the noisy phase, the share of responses that are wrong on purpose
WARM_UP_NOISY_SHARE = 1 / 3  # the last third of the warm-up steps is the noisy phase


def noisy_response(row: dict, noise: float, rng: random.Random) -> str:
    """ideal_response, except that with probability noise the result is off by 1 to 3 (a wrong
    answer drawn uniformly from c-3..c+3 without c and below 0), in the calculation and in <answer>."""
    if rng.random() >= noise:
        return ideal_response(row)
    c = row["answer_only"]
    return ideal_response(row, rng.choice([x for x in (c - 3, c - 2, c - 1, c + 1, c + 2, c + 3) if x >= 0]))


def warm_up(
    model, tokenizer, prompts_and_rows, steps, seed=0, noise=0.0, noisy_steps=0, lr=WARM_UP_LR, batch_size=WARM_UP_BATCH
):
    """A short supervised warm-up on (prompt, response) pairs, loss on the response only; each
    response is drawn afresh by noisy_response(row, noise), so a fraction noise of them is wrong.

    RL then starts, as from Qwen2.5-Instruct, from a model that knows the answer format and is
    sometimes right. From random weights it is almost never right, and the paper's dynamic sampling
    (keep a group only if 0 < #correct < G) would skip every group.
    """
    end = "<|im_end|>"
    prompts = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt, _ in prompts_and_rows]
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        for step in range(steps):
            noisy = step >= steps - noisy_steps  # the last noisy_steps: wrong answers, and the lr falling to 0
            step_noise = noise if noisy else 0.0
            picks = rng.sample(range(len(prompts)), min(batch_size, len(prompts)))
            responses = [noisy_response(prompts_and_rows[k][1], step_noise, rng) + end for k in picks]
            response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
            batch = [(prompts[k] + r, [-100] * len(prompts[k]) + r) for k, r in zip(picks, response_ids)]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
            lengths = torch.tensor([len(ids) for ids, _ in batch])
            attention_mask = (torch.arange(width)[None] < lengths[:, None]).long()  # right padding
            model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
            if noisy:  # so that the model fits the mix of answers, not the last batches
                optimizer.param_groups[0]["lr"] = lr * (steps - step) / noisy_steps
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    return model


@contextlib.contextmanager
def one_torch_thread():
    """The warm-up on one torch thread: a hidden-64 model gains little from more, and on a loaded 2-core
    machine two threads wait on each other (90 warm-up steps, load ~16: 55 s at 1 thread, 291 s at 2; the
    weights are the same to the bit)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_tiny_world(
    root: str,
    system_prompt: str,
    num_train: int = DEMO_NUM_TRAIN,
    num_test: int = DEMO_NUM_TEST,
    seed: int = 0,
    warm_up_steps: int = 0,
    warm_up_noise: float = WARM_UP_NOISE,
    vocab_size: int = VOCAB_SIZE,
) -> tuple[str, str]:
    """Write the data set to root/gsm8k_tiny and the tokenizer + model to root/tiny-qwen2.

    warm_up_steps > 0 first teaches the model the answer format and the facts on the training problems
    (warm_up); its last WARM_UP_NOISY_SHARE of steps use responses of which warm_up_noise are wrong.
    vocab_size: the tokenizer's (see build_tokenizer).
    """
    data_dir = write_dataset(os.path.join(root, "gsm8k_tiny"), num_train, num_test, seed)
    splits = make_splits(num_train, num_test, seed)
    rows = splits["train"] + splits["test"]
    # Every prompt train.py will build, plus a well-formatted answer, so that the tokenizer covers
    # all characters and the ideal completion is learnable.
    texts = [chatml_prompt(system_prompt, row["question_zh-cn"]) + ideal_response(row) + "<|im_end|>\n" for row in rows]
    tokenizer = build_tokenizer(texts, vocab_size)
    model = build_tiny_model(tokenizer, seed)
    if warm_up_steps:
        pairs = [(chatml_prompt(system_prompt, row["question_zh-cn"]), row) for row in splits["train"]]
        noisy_steps = round(warm_up_steps * WARM_UP_NOISY_SHARE)
        with one_torch_thread():
            warm_up(model, tokenizer, pairs, warm_up_steps, seed, noise=warm_up_noise, noisy_steps=noisy_steps)

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
# With these settings a demo takes about a minute of one CPU core, world included, and its held-out
# accuracy climbs (the measured runs: docs/demo.md); anything given on the command line still wins (e.g.
# --max_steps=50, --seed=1, --lr=0, or --preset paper --filter_metric=reward).
DEMO_ARGS = dict(
    model_path=os.path.join(DEMO_DIR, "tiny-qwen2"),
    data_path=os.path.join(DEMO_DIR, "gsm8k_tiny"),
    output_dir=DEMO_DIR,
    device="cpu",
    num_threads=1,  # the same samples on a machine of any core count; a hidden-64 model gains nothing from more
    lr=3e-4,  # seed 42: 1e-3 collapsed after ~20 steps (held-out 0.22 -> 0.07); 5e-4 climbed only +0.29 in 160
    max_grad_norm=1.0,  # verl's DAPO script
    num_generations=8,
    batch_size=4,  # prompts per micro-batch; a step's 8 prompts are sampled in one call of 64 rows
    max_generate_length=20,  # an ideal response is 15 tokens with its <|im_end|>
    epoch=100,
    max_steps=160,
    eval_steps=20,
    eval_samples=DEMO_NUM_TEST,  # the whole test split, every time: no subset noise
    eval_batch_size=DEMO_NUM_TEST,  # in one sampling call
    save_steps=80,  # checkpoints at steps 80 and 160: an interrupted demo resumes with --demo --resume=latest
)
DEMO_WARM_UP_STEPS = 450  # 300 clean, then 150 noisy (WARM_UP_NOISY_SHARE)
# --demo --preset paper uses the same world and settings: the warm-up leaves the model right ~1 time in 5 at the
# paper's temperature 1, so its filter (keep a group only if 0 < #correct < G) keeps most groups.


def demo_summary(history, args, wall_seconds, resumed_from=None, command="python train.py", restart=None):
    """The closing lines of a demo: held-out accuracy, strict and lenient (evaluation.py), at step 0 and at the
    last evaluation (the headline, with every evaluation), then the mean total and correctness reward over the
    first and last 50 sampled steps (or fifth of them; with steps_per_generation 4 one step in 4 samples), the
    logs, the wall time of the command, and what to run next (demo_next_steps, with command: python_command()).
    history is trainer.history: one metrics dict per optimizer step; resumed_from: the checkpoint a --resume
    started from (None: a fresh demo, which built its world)."""
    output_dir, steps = args.output_dir, history[-1]["step"]
    skipped = f"{history[-1]['skipped_groups']:,} groups skipped by dynamic sampling over all {steps} steps"
    lines = [f"\ndemo summary after {steps} steps ({skipped}):"]
    for label, accuracy in zip(("held-out accuracy", "lenient accuracy"), read_accuracies(output_dir)):
        if accuracy:  # both at full precision (evaluations.jsonl), written to 2 decimals: the gains agree
            (first_step, first), (last_step, last) = min(accuracy.items()), max(accuracy.items())
            change = f"  ->  step {last_step} {last:.2f}  ({last - first:+.2f})" if last_step != first_step else ""
            lines.append(
                f"  {label:<17}  step {first_step} {first:.2f}{change}"
                f"  [every evaluation: {' '.join(f'{accuracy[s]:.2f}' for s in sorted(accuracy))}]"
                + unevaluated_steps(output_dir, last_step)
            )

    def first_and_last(key):  # (window, mean over the first and the last `window` steps that have key)
        values = [record[key] for record in history if record.get(key) is not None]  # 4 steps per rollout: 1 in 4
        if not values:
            return 0, math.nan, math.nan
        window = max(1, min(50, len(values) // 5))
        return window, sum(values[:window]) / window, sum(values[-window:]) / window

    lines += [
        f"  {label:<18} first {n} sampled steps {start:.3f}  ->  last {n} {end:.3f}  ({end - start:+.3f})"
        for label, (n, start, end) in (
            ("mean total reward", first_and_last("reward")),
            ("correctness reward", first_and_last("rewards/correctness_reward/mean")),
        )
    ]
    minutes, seconds = divmod(round(wall_seconds), 60)
    how = f"from {os.path.basename(resumed_from)}" if resumed_from else "the world's construction and warm-up included"
    lines += [
        f"  logs: {output_dir}/accuracy_losses.txt, evaluations.jsonl, training_losses.txt, metrics.jsonl; curves.png",
        f"  wall time: {minutes} min {seconds:02d} s, {how}",
    ]
    return "\n".join(lines + demo_next_steps(args, command, restart or f"{command} --demo"))


def demo_next_steps(args, command, restart):
    """Ready-to-paste commands on the demo's own folders, each run by command (the interpreter and script that ran
    the demo: with or without the venv activated, they run): its two models compared greedily on the problems its
    evaluations used, into a folder of its own that a second paste overwrites; the curves redrawn; and (when a
    checkpoint is there) as many steps again from the newest one, whose settings it keeps, started by restart (the
    demo's own launcher and processes, and --demo)."""
    output_dir = args.output_dir
    path = lambda *names: shlex.quote(shown_path(os.path.join(output_dir, *names)))  # noqa: E731
    demo, evaluated, model, data = path(), path("eval"), path("tiny-qwen2"), path("gsm8k_tiny")
    every = args.eval_samples == 0 or args.eval_samples >= DEMO_NUM_TEST  # evaluation.evaluate_model's choice
    problems = f"all {DEMO_NUM_TEST}" if every else f"{args.eval_samples} random"
    lines = [
        "next steps (ready to paste in this folder):",
        f"  # the warm-up model (RL's start) beside the trained one, greedy, on {problems} test problems",
        f"  {command} --eval_only --model_path={model} --compare={demo} --data_path={data} --device={args.device}"
        f" --max_generate_length={args.max_generate_length} --eval_samples={args.eval_samples}"
        f" --eval_batch_size={args.eval_batch_size} --output_dir={evaluated} --overwrite_output_dir=true",
        "  # curves.png again, from the logs",
        f"  {command} --plot={demo}",
    ]
    if find_checkpoints(output_dir):
        step = max(find_checkpoints(output_dir))
        lines += [
            f"  # {step} more steps, from checkpoint_{step}",
            f"  {restart} --resume=latest --output_dir={demo} --max_steps={2 * step}",
        ]
    return lines


def demo_world(output_dir, system_prompt, overwrite=False, warm_up_steps=DEMO_WARM_UP_STEPS):
    """A fresh demo in output_dir, marked as the demo's (DEMO_MARKER). A folder an earlier demo made is emptied, its
    final model and evaluations too (all of it is that demo's; this run holds the lock); another run's folder is
    refused, unless overwrite (run_dir.claim_output_dir: its logs and checkpoints go). Then build the world there; a
    build that does not finish (Ctrl-C, SIGTERM, a full disk) removes its folders, and the marker if it wrote it.
    Returns (model_dir, data_dir)."""
    marker = os.path.join(output_dir, DEMO_MARKER)
    made = [] if os.path.exists(marker) else [marker]
    if made:
        claim_output_dir(output_dir, overwrite, demo=True)
    else:
        for name in set(os.listdir(output_dir)) - {LOCK_FILE, DEMO_MARKER}:
            path = os.path.join(output_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
    try:
        with writing("the demo's world to", output_dir, "; none of it is left"):  # a full disk: one line
            with open(marker, "w", encoding="utf-8") as f:
                f.write("made by `python train.py --demo`: a new demo may clear this folder\n")
            return build_tiny_world(output_dir, system_prompt, warm_up_steps=warm_up_steps)
    except BaseException:  # Ctrl-C, SIGTERM (launch: Interrupted) or a full disk: no half-built world stays
        for name in ("gsm8k_tiny", "tiny-qwen2"):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
