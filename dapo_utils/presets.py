"""--preset: named settings under the command line's (which win). "seed" sets nothing: the seed's defaults.

The ladder of the DAPO paper's Table 1 (arXiv 2503.14476; AIME 2024 avg@32 of Qwen2.5-32B beside each rung): each
rung adds one technique to the rung below, and sets that technique's fields alone (LADDER; test_ablation.py holds
every pair of neighbours to it). The last rung, "paper", is DAPO as the paper runs it (Sec. 4.1), scaled to this
setting. Beside the ladder, the GRPO family (VARIANTS), each the ladder's naive GRPO with its own technique.
docs/paper-options.md gives each rung's settings with the paper's section; docs/ablation.md what they measure.
"""

# Sec. 4.1's training settings, which every rung keeps (the paper trains its naive GRPO baseline with them too).
COMMON = dict(
    steps_per_generation=4,  # paper: 16 updates per rollout (512 x 16 responses, mini-batches of 512)
    temperature=1.0,  # verl's recipe samples the policy itself: temperature 1, no top-k, top-p 1
    top_k=0,
    score_with_temperature=True,  # TRL and verl score under the sampling distribution
    weight_decay=0.1,  # AdamW: verl's DAPO script (the paper: AdamW, constant lr 1e-6)
    warmup_steps=10,  # verl's DAPO script (the paper: linear warm-up over 20 rollout steps)
    max_grad_norm=1.0,  # verl's DAPO script
    beta=0.0,  # Sec. 2.3 removes the KL term; Table 1 lists no KL rung, so the baseline has none either
)
# Naive GRPO (Sec. 2.2, Eq. 6): the fields of the techniques that the rungs above turn on, in their GRPO state.
GRPO = dict(
    clip_eps_low=0.2,  # symmetric clip, PPO's 0.2
    clip_eps_high=0.2,
    loss_agg_mode="seq-mean-token-mean",  # sample-level: each response's token mean, then the mean over responses
    filter_metric="none",  # no dynamic sampling: every group trains, also those without signal
    overlong_filter=False,  # truncated responses train like the others
    overlong_buffer_len=0,  # no length-aware reward
)


def ladder(max_generate_length):
    """[(preset, label, paper's section, AIME 2024 of Table 1, the fields it changes)], naive GRPO to DAPO."""
    return [
        ("grpo", "naive GRPO", "Sec. 2.2", 30, {}),
        ("overlong_filter", "+ overlong filtering", "Sec. 3.4", 36, dict(overlong_filter=True)),
        ("clip_higher", "+ clip-higher", "Sec. 3.1", 38, dict(clip_eps_high=0.28)),
        # Sec. 3.4's second treatment of truncated responses replaces the first: the soft punishment shapes their
        # reward where filtering dropped their loss (verl's recipe/dapo, the paper's code, has no filtering)
        (
            "soft_overlong",
            "+ soft overlong punishment",
            "Sec. 3.4, Eq. 13",
            41,
            dict(overlong_filter=False, overlong_buffer_len=max_generate_length // 5),  # L_cache 4096 of 20480
        ),
        ("token_loss", "+ token-level loss", "Sec. 3.3, Eq. 12", 42, dict(loss_agg_mode="token-mean")),
        ("paper", "+ dynamic sampling = DAPO", "Sec. 3.2, Eq. 11", 50, dict(filter_metric="correctness")),
    ]


# The GRPO family beside the ladder: naive GRPO with (label, paper, its fields).
VARIANTS = {
    "dr_grpo": (
        "Dr. GRPO",
        "arXiv 2503.20783, Sec. 3.2",
        dict(scale_rewards="none", loss_agg_mode="seq-mean-token-sum-norm"),  # no std, a constant normaliser
    ),
    "gspo": (
        "GSPO",
        "arXiv 2507.18071, Sec. 4",
        # the sequence-level ratio, clipped per response at GSPO's own range (Sec. 5.1: 3e-4 and 4e-4)
        dict(importance_sampling_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4),
    ),
}


def presets(max_generate_length):
    """{preset name: the fields it sets}: seed, the ladder's rungs (each the one below plus its technique) and the
    variants (naive GRPO plus theirs)."""
    settings, below = {"seed": {}}, COMMON | GRPO
    for name, _, _, _, fields in ladder(max_generate_length):
        settings[name] = below = below | fields
    return settings | {name: COMMON | GRPO | fields for name, (_, _, fields) in VARIANTS.items()}


PRESETS = list(presets(1))  # the names --preset takes


def preset_fields(preset, max_generate_length):
    """The fields --preset=NAME sets, for this length budget (the soft punishment's L_cache follows it)."""
    return presets(max_generate_length)[preset]


def paper_preset(max_generate_length):
    """The paper's recipe (arXiv 2503.14476, Sec. 4.1; verl's recipe/dapo), scaled to this setting: the ladder's top."""
    return preset_fields("paper", max_generate_length)
