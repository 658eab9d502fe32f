"""Greedy ids of every tree drafter (Sequoia trees, width trees, chains, Lookahead) against plain decoding on a
device, acceptance graphed on CUDA (random-weight llama-68m: the check is losslessness, not acceptance); the
output of a run is in results/trees/gpu_greedy_check/.
    python3 benchmarks/tree_greedy_check.py cuda 1536 128 [--dtype float32]"""
import sys
from magicdec.cli import run_record
dev = sys.argv[1]
base = ["--random_weights", "--model_name", "JackFram/llama-68m", "--prefix_len", sys.argv[2], "--B", "4", "--gen_len",
        sys.argv[3], "--save_tokens", "--no_progress", "--device", dev] + (["--step_mode", "cuda_graphs"] if dev == "cuda" else []) + sys.argv[4:]
ref = run_record(base)
seq = ["--tree_nodes", "20", "--tree_rates", "0.8", "0.5", "0.4"]
for extra in (["--drafter", "selfspec", "--draft_budget", "128", "--gamma", "4", *seq],
              ["--drafter", "selfspec", "--draft_budget", "128", "--gamma", "4", "--reindex", *seq],
              ["--drafter", "selfspec", "--draft_budget", "128", "--gamma", "4", "--draft_policy", "snapkv", *seq],
              ["--drafter", "selfspec", "--draft_budget", "128", "--gamma", "3", "--tree_width", "3"],
              ["--drafter", "selfspec", "--draft_budget", "128", "--gamma", "3"],
              ["--drafter", "lookup", "--gamma", "4", "--tree_width", "3"],
              ["--drafter", "lookahead", "--gamma", "5", "--ngram_size", "3", "--guesses", "4"]):
    r = run_record(base + extra)
    print(" ".join(extra[1:]), "same ids:", r["generated_ids"] == ref["generated_ids"], {k: r["metrics"].get(k) for k in ("alpha", "acceptance_length", "T_V_over_T_T", "measured_speedup")}, flush=True)
