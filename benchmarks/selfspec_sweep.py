"""Self-speculation vs baseline over a grid, in one process: the model is loaded once, each (prefix, B) prefilled
once, each draft budget prefilled once, then every gamma and decoding mode (greedy, and sampled at temperature 0.6 /
top-p 0.9) is timed against the baseline of the same mode. One JSON record per point under --output_dir, a
summary.json, and a table at the end. Decode steps run as CUDA graphs (plain capture, no torch.compile).

    python benchmarks/selfspec_sweep.py --model /tmp/smol/model.pth --dataset books/ --prefix_lens 4000 8000 \
        --batch_sizes 32 64 128 256 --budgets 256 512 --gammas 2 3 4 5 --output_dir results/issue3/smollm2
    python benchmarks/selfspec_sweep.py --random_weights --model_name meta-llama/Meta-Llama-3.1-8B \
        --synthetic_acceptance 0.8 --prefix_lens 32768 --batch_sizes max --budgets 512 --gammas 2 3 4 --modes greedy
"""
import argparse
import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from magicdec import benchmark as bench  # noqa: E402
from magicdec import runs  # noqa: E402
from magicdec.generate import Decoder, Draft, Sampling, prefill  # noqa: E402
from magicdec.kv_cache import KVCache, StreamingCache  # noqa: E402
from magicdec.sampling import next_token  # noqa: E402

MODES = {"greedy": Sampling(0.0), "sampled": Sampling(0.6, 0.9)}

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", type=Path)
p.add_argument("--model_name")
p.add_argument("--random_weights", action="store_true")
p.add_argument("--tokenizer", type=Path)
p.add_argument("--dataset", default="auto")
p.add_argument("--prefix_lens", type=int, nargs="+", required=True)
p.add_argument("--batch_sizes", nargs="+", required=True, help="integers, or 'max' for the largest that fits")
p.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
p.add_argument("--gammas", type=int, nargs="+", default=[2, 3, 4])
p.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=list(MODES))
p.add_argument("--gen_len", type=int, default=64)
p.add_argument("--sinks", type=int, default=16)
p.add_argument("--synthetic_acceptance", type=float, default=None)
p.add_argument("--prefill_backend", default="sdpa", help="sdpa (no compile per shape) or flex")
p.add_argument("--output_dir", type=Path, required=True)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--no_fuse", action="store_true", help="plain PyTorch elementwise ops (see model.fuse_elementwise)")
p.add_argument("--device", default="cuda", help="cpu only to check the script itself (no graphs, float32)")
cli = p.parse_args()

device = torch.device(cli.device)
graphs = device.type == "cuda"
dtype = torch.bfloat16 if graphs else torch.float32
args = SimpleNamespace(model=cli.model, model_name=cli.model_name, random_weights=cli.random_weights,
                       tokenizer=cli.tokenizer, dataset=cli.dataset, skip_tokens=8000, seed=cli.seed,
                       gen_len=cli.gen_len, compile=False, cuda_graphs=graphs, device=device,
                       dtype="bfloat16" if graphs else "float32")
config, checkpoint = bench.model_source(args)
sizes_max = {}
if "max" in cli.batch_sizes:  # before the weights are loaded: largest_batch counts them itself
    for P in cli.prefix_lens:
        draft_slots = tuple(b + runs.ring_extra_for(cli.gen_len, max(cli.gammas)) for b in cli.budgets)
        sizes_max[P] = bench.largest_batch(config, P, cli.gen_len + max(cli.gammas) + 2, dtype, device,
                                           headroom=4 << 30, draft_slots=draft_slots)
target = bench.load_weights(args, config, checkpoint)
if graphs and not cli.no_fuse:
    runs.fuse_kernels()
copy_bw = bench.copy_bandwidth(device)
cli.output_dir.mkdir(parents=True, exist_ok=True)
env = bench.environment(device)
summary = []


def extra(gamma):
    return runs.ring_extra_for(cli.gen_len, gamma)


def release():
    gc.collect()  # a Decoder and its CUDA graphs form a reference cycle: collect it before measuring free memory
    if graphs:
        torch.cuda.empty_cache()


def fits(B, P):
    release()
    slots = P + cli.gen_len + max(cli.gammas) + 2
    chunk = max(16, 16384 // B)
    parts = [(config, False, slots)] + [(config, False, b + extra(max(cli.gammas))) for b in cli.budgets]
    need = bench.memory_needed(B, chunk, dtype, parts)
    return need["total"] + (3 << 30) <= bench.available_memory(device) + need["weights"]  # weights already loaded


def record(kind, B, P, mode, metrics, budget=None, gamma=None):
    rec = {"method": kind, "B": B, "prefix_len": P, "decoding": mode, "budget": budget, "gamma": gamma,
           "sinks": cli.sinks, "gen_len": cli.gen_len, "model": config.name, "random_weights": cli.random_weights,
           "synthetic_acceptance": cli.synthetic_acceptance, "prompt_source": args.prompt_source,
           "cuda_graphs": graphs, "copy_bandwidth_GBps": copy_bw / 1e9 if copy_bw else None, "environment": env, "metrics": metrics}
    name = f"{kind}_P{P}_B{B}_{mode}" + (f"_b{budget}_g{gamma}" if kind == "selfspec" else "") + ".json"
    (cli.output_dir / name).write_text(json.dumps(rec, indent=1))
    summary.append(rec)
    m = metrics
    line = f"{kind:8s} P={P:6d} B={B:4d} {mode:7s}"
    if kind == "selfspec":
        line += (f" budget={budget:4d} gamma={gamma} alpha={m['alpha']:.3f} Omega={m['omega']:.2f} "
                 f"T_D/T_T={m.get('T_D_over_T_T', 0):.3f} T_V/T_T={m.get('T_V_over_T_T', 0):.3f} "
                 f"speedup={m.get('measured_speedup', 0):.3f} predicted={m.get('predicted_speedup', 0):.3f} "
                 f"Omega_eff={m.get('omega_effective', 0):.2f} predicted_eff={m.get('predicted_speedup_effective', 0):.3f} "
                 f"speedup_first_done={m.get('measured_speedup_first_done', 0):.3f}")
    else:
        line += f" {m['ms_per_step']:.3f} ms/step {m['decode_tokens_per_s']:.0f} tok/s"
    print(line, flush=True)


decode_backend = "triton" if graphs else "sdpa"
with torch.inference_mode():
    for P in cli.prefix_lens:
        sizes = [int(b) for b in cli.batch_sizes if b != "max"]
        if P in sizes_max:  # the pre-load estimate is an upper bound; step down until the loaded state fits
            B = sizes_max[P]
            while B > 1 and not fits(B, P):
                B -= 1
            sizes.append(B)
        for B in sizes:
            if not fits(B, P):
                print(f"skip P={P} B={B}: does not fit", flush=True)
                continue
            args.B, args.prefix_len = B, P
            run_args = SimpleNamespace(**vars(args))
            prompts, _ = bench.load_prompts_for(args, config, checkpoint)
            prompts = prompts.to(device)
            chunk = max(16, 16384 // B)
            slots = P + cli.gen_len + max(cli.gammas) + 2
            cache = KVCache(config.n_layers, B, config.n_kv_heads, slots, config.head_dim, dtype, device, cli.prefill_backend)
            logits = prefill(target, cache, prompts, chunk)
            cache.backend = decode_backend
            drafts = {}
            for budget in cli.budgets:
                dc = StreamingCache(config.n_layers, B, config.n_kv_heads, budget, cli.sinks,
                                    extra(max(cli.gammas)), config.head_dim, dtype, device, cli.prefill_backend)
                prefill(target, dc, prompts, min(chunk, runs.DRAFT_PREFILL_CHUNK))
                dc.backend = decode_backend
                drafts[budget] = dc
            for mode in cli.modes:
                sampling = MODES[mode]
                torch.manual_seed(cli.seed)
                first = next_token(logits, sampling.temperature, sampling.top_p, sampling.top_k)
                cache.rollback(torch.full_like(cache.lengths, P))
                base = Decoder(target, sampling, cuda_graphs=graphs)
                _, counts, secs = runs.timed_generation(base, cache, first, prompts[:, -1], run_args, [], False)
                base_m = runs.generation_metrics(counts, secs, run_args, base.stats)
                base_m.update(runs.bandwidth_metrics(target, config, run_args, dtype, secs, copy_bw))
                record("baseline", B, P, mode, base_m)
                for budget, dc in drafts.items():
                    for gamma in cli.gammas:
                        cache.rollback(torch.full_like(cache.lengths, P))
                        dec = Decoder(target, sampling, draft=Draft(target, dc), gamma=gamma, cuda_graphs=graphs,
                                      synthetic_acceptance=cli.synthetic_acceptance)
                        _, counts, secs = runs.timed_generation(dec, cache, first, prompts[:, -1], run_args, [], False)
                        m = runs.generation_metrics(counts, secs, run_args, dec.stats)
                        m.update(runs.speculation_metrics(m, dec.stats, base_m, gamma))
                        record("selfspec", B, P, mode, m, budget, gamma)
                        del dec
                del base
            del cache, drafts, logits, prompts
            release()
(cli.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"wrote {len(summary)} records to {cli.output_dir}")
