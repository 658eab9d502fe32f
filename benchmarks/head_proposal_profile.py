"""Where a head drafter's proposal spends its time, kernel by kernel: the part of T_D the cost model does not count.

Each case is one run (random weights, a fresh head, --skip_prefill, synthetic per-position acceptance) as a sweep
makes it, twice: with --step_mode eager, the proposals after the warm-up run under torch.profiler (every GPU kernel's
time per proposal, by kernel and by group: matmuls, attention, the sampled pick's sort / scan / softmax / draw, the
rest); with --step_mode cuda_graphs, each proposal is timed between CUDA events as the runs replay it (one graph).
Beside them, the run's own T_D/T_T and T_T. The groups say what a proposal costs beyond its weights' bytes: the
sampled pick's passes over the vocabulary, the small kernels' launches inside the graph.

    python benchmarks/head_proposal_profile.py --head_candidates 0 64 --output results/heads/proposal_profile.json
    python benchmarks/head_proposal_profile.py --device cpu --cases tiny --output /tmp/p.json   # a smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

from magicdec import files
from magicdec.cli import run_record
from magicdec.drafters import head_draft
from magicdec.errors import one_line_errors

GROUPS = (("matmul", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitk", "addmm", "mm")),
          ("attention", ("attn", "attention", "_decode", "split_kv", "flash")),
          ("sort / scan (top-p)", ("sort", "radix", "scan", "cumsum")),
          ("softmax / draw", ("softmax", "exponential", "multinomial", "distribution", "argmax", "topk")),
          ("reduce", ("reduce",)),
          ("norm / RoPE / SwiGLU (fused)", ("triton_", "rms_norm")),
          ("gather / index / copy", ("index", "gather", "scatter", "copy", "cat")))

SHAPES = {  # name: (model, prefix_len, B, per-position acceptance: SmolLM2's trained EAGLE head, sampled)
    "smollm2_8000x8": ("HuggingFaceTB/SmolLM2-135M", 8000, 8),
    "smollm2_8000x64": ("HuggingFaceTB/SmolLM2-135M", 8000, 64),
    "llama31_8b_32kx1": ("meta-llama/Meta-Llama-3.1-8B", 32768, 1),
    "tiny": ("JackFram/llama-68m", 512, 2),
}
HEADS = {"eagle": ["--drafter", "eagle"], "eagle_window": ["--drafter", "eagle", "--head_kv", "window"],
         "hydra": ["--drafter", "hydra"], "medusa": ["--drafter", "medusa"]}


def group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")


class Probe:
    """Wraps HeadDraft.propose: the proposals numbered (warm, warm + count] are profiled (eager) or timed (graphed)."""

    def __init__(self, warm: int, count: int, cuda: bool):
        self.warm, self.count, self.cuda = warm, count, cuda
        self.calls, self.kernels, self.us = 0, {}, []
        self.inner = head_draft.HeadDraft.propose

    def __enter__(self):
        probe = self

        def propose(drafter, *args):
            probe.calls += 1
            if not probe.warm < probe.calls <= probe.warm + probe.count:
                return probe.inner(drafter, *args)
            return probe.timed(drafter, args) if drafter.graph is not None else probe.profiled(drafter, args)
        head_draft.HeadDraft.propose = propose
        return self

    def __exit__(self, *exc):
        head_draft.HeadDraft.propose = self.inner

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def profiled(self, drafter, args):
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU]) as prof:
            out = self.inner(drafter, *args)
            self.sync()
        for e in prof.key_averages():
            us = e.device_time_total if self.cuda else e.self_cpu_time_total
            if us > 0 and e.count:
                k = self.kernels.setdefault(e.key, {"us": 0.0, "calls": 0})
                k["us"] += us
                k["calls"] += e.count
        self.us.append(None)
        return out

    def timed(self, drafter, args):
        self.sync()
        if not self.cuda:
            return self.inner(drafter, *args)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = self.inner(drafter, *args)
        b.record()
        b.synchronize()
        self.us.append(a.elapsed_time(b) * 1e3)
        return out

    def summary(self) -> dict:
        n = max(1, len(self.us))
        kernels = {k: {"us_per_proposal": v["us"] / n, "calls_per_proposal": v["calls"] / n, "group": group(k)}
                   for k, v in self.kernels.items()}
        groups = {}
        for k in kernels.values():
            g = groups.setdefault(k["group"], {"us_per_proposal": 0.0, "kernels_per_proposal": 0.0})
            g["us_per_proposal"] += k["us_per_proposal"]
            g["kernels_per_proposal"] += k["calls_per_proposal"]
        timed = sorted(u for u in self.us if u is not None)
        return {"proposals": len(self.us), "kernel_us_per_proposal": sum(k["us_per_proposal"] for k in kernels.values()),
                "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["us_per_proposal"])),
                "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_proposal"])[:12]),
                "graphed_us_median": timed[len(timed) // 2] if timed else None}


def case(shape: str, head: str, candidates: int, a) -> dict:
    model, prefix, B = SHAPES[shape]
    base = ["--random_weights", "--skip_prefill", "--model_name", model, "--prefix_len", str(prefix), "--B", str(B),
            "--gen_len", str(a.gen_len), "--gamma", str(a.gamma), "--synthetic_acceptance", "0.402",
            "--synthetic_positions", *[str(r) for r in a.rates[:a.gamma]], "--no_progress", "--device", a.device]
    base += [] if a.decoding == "greedy" else ["--temperature", "0.6", "--top_p", "0.9"]
    cuda = a.device.startswith("cuda")
    base += ["--head_candidates", str(candidates)]
    row = {"shape": shape, "model": model, "prefix_len": prefix, "B": B, "head": head, "gamma": a.gamma,
           "decoding": a.decoding, "head_candidates": candidates}
    for mode in ("eager", "cuda_graphs") if cuda else ("eager",):
        with Probe(a.warm, a.count, cuda) as probe, contextlib.redirect_stdout(io.StringIO()):  # the run's table
            r = run_record(base + HEADS[head] + ["--step_mode", mode])
        m = r["metrics"]
        t = m["speculation"]["time_s"]
        row[mode] = probe.summary() | {
            "T_D_over_T_T": m.get("T_D_over_T_T"), "alpha": m.get("alpha"),
            "draft_s_per_proposal": t["draft"] / max(1, m["speculation"]["iterations"]),
            "baseline_ms_per_step": (r.get("baseline_metrics") or {}).get("ms_per_step")}
        s = row[mode]
        print(f"{shape} {head} candidates {candidates} {mode}: T_D/T_T {s['T_D_over_T_T'] or float('nan'):.3f}, "
              f"{s['draft_s_per_proposal'] * 1e6:.0f} us per "
              f"proposal in the run" + (f", {s['graphed_us_median']:.0f} us between events" if s["graphed_us_median"]
                                        else f", kernels {s['kernel_us_per_proposal']:.0f} us"), flush=True)
        for g, v in s["groups"].items():
            print(f"   {g:30s} {v['us_per_proposal']:8.1f} us  {v['kernels_per_proposal']:6.1f} kernels", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--cases", nargs="*", default=["smollm2_8000x8", "llama31_8b_32kx1"], choices=sorted(SHAPES))
    p.add_argument("--heads", nargs="*", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--gamma", type=int, default=2)
    p.add_argument("--rates", type=float, nargs="*", default=[0.408, 0.396, 0.39, 0.38],
                   help="per-position acceptance (SmolLM2's trained EAGLE head, sampled, results/heads)")
    p.add_argument("--decoding", choices=("sampled", "greedy"), default="sampled")
    p.add_argument("--head_candidates", type=int, nargs="*", default=[64],
                   help="the heads' sampled candidates (0: the whole vocabulary), each a case")
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--warm", type=int, default=40, help="proposals left alone first (the warm-up generation's)")
    p.add_argument("--count", type=int, default=10, help="proposals profiled / timed after those")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    rows = []
    with one_line_errors():
        for shape in a.cases:
            for head in a.heads:
                for k in a.head_candidates:
                    rows.append(case(shape, head, k, a))
                a.output.parent.mkdir(parents=True, exist_ok=True)
                files.write_json(a.output, {"command": " ".join(sys.argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
