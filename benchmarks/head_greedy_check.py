"""Greedy ids of every head drafter against plain decoding on the GPU, proposals eager or replayed as CUDA graphs
(fresh heads over a random-weight llama-68m: the check is losslessness, not acceptance).
    python3 benchmarks/head_greedy_check.py 1536 128 [--dtype float32] [--step_mode eager]
The logs of its runs are in results/heads/gpu_check/."""
import sys

from magicdec.cli import run_record

base = ["--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", sys.argv[1], "--B", "4", "--gen_len",
        sys.argv[2], "--save_tokens", "--no_progress", "--device", "cuda", "--step_mode", "cuda_graphs"] + sys.argv[3:]
ref = run_record(base)
for extra in (["--drafter", "eagle", "--gamma", "3"],
              ["--drafter", "eagle", "--gamma", "3", "--head_kv", "window", "--head_budget", "128"],
              ["--drafter", "eagle", "--gamma", "3", "--tree_width", "2"],
              ["--drafter", "eagle", "--gamma", "3", "--eagle3", "--eagle3_layers", "1", "2", "--head_kv", "window", "--head_budget", "128"],
              ["--drafter", "medusa", "--gamma", "3"],
              ["--drafter", "medusa", "--gamma", "3", "--tree_width", "2"],
              ["--drafter", "hydra", "--gamma", "3"],
              ["--drafter", "hydra", "--gamma", "3", "--tree_width", "2"]):
    r = run_record(base + extra)
    print(" ".join(extra[1:]), "same ids:", r["generated_ids"] == ref["generated_ids"],
          {k: r["metrics"].get(k) for k in ("alpha", "acceptance_length", "T_D_over_T_T")}, flush=True)
