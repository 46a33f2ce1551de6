"""dapo_utils: what train.py and reward_func.py stand on. The algorithm (DapoArguments, the DAPO maths, DapoTrainer)
and the rewards live in those two scripts; this package holds the rest, and never imports them.

Floors, top to bottom: a module imports only modules on lower floors (tests/test_docs.py holds the code to this
plan, and to every module being in it). Optional extras (vLLM, peft, math-verify) are imported only where used.

    floor  module        what it holds
    7      launch        what `python train.py` does around a run: its modes, the lock, one line for each way it ends
    6      ablation      --ablation: the paper's ladder, a run per rung and seed; ablation.json, .md, .png
    6      cli           command line: parsed into fields and modes, the settings of --demo / --resume, the checks
    6      evaluation    strict and lenient accuracy, pass@k / maj@k, --eval_only and --compare, the run's summary
    5      tiny_world    the offline world of --demo and the tests: data set, tokenizer, a warmed-up 2-layer Qwen2
    4      guards        a diverged or starved run, or a data set too small for a step, stopped in one line
    4      record        output_dir/dapo_args.json at a run's start: settings, rewards, command, versions, commit
    4      run_dir       the output folder a run holds (its lock) and a fresh run claims
    3      checkpoints   loading the policy; checkpoints that resume exactly; the final save; Ctrl-C, SIGTERM, SIGHUP
    3      rewards       --reward_funcs resolved, reward models, one function's scores checked, --check_rewards
    2      curves        curves.png and the readers of a run's logs
    2      data          any local data set's question / answer rows, answer formats, the system prompt
    2      fsdp          --fsdp: the policy sharded over the ranks (FSDP2)
    2      math_checker  --answer_checker=math_verify (optional extra)
    2      options       the options and --help (read from train.py's text, before torch loads); commands to print
    2      packing       groups padded, trimmed, packed (padding_free) and balanced into micro-batches
    2      vllm_sampler  --use_vllm: a vLLM engine in the training process (optional extra)
    1      answers       reading and comparing answers: the seed's rule, the lenient rule, exact numbers
    1      decoding      the default sampler: the decode loop (CPU), generate over CUDA graphs (CUDA)
    1      distributed   torchrun / accelerate launch: the collectives (no-ops in one process)
    1      flops         model FLOPs and bytes from the shapes, the device's roof: perf/throughput, mfu, roofline
    1      kernels       log-probs from the hidden states, bf16 autocast, freed memory reused on CPU
    1      lora          --lora_r: LoRA adapters through peft (optional extra)
    1      notices       the project's warnings, one line each (DapoWarning)
    1      presets       --preset: seed, the paper's ladder (grpo ... paper), the GRPO family (dr_grpo, gspo)
    1      time_limits   time limits for code that may hang (a reward function, a math-verify check)
    1      trackers      one metrics record per step; TensorBoard, W&B, Trackio
    1      writes        a failed write (a full disk) in one line
"""
