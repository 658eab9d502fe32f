"""MagicDec's analysis as code: bytes and FLOPs of a step, predicted step times from a device's measured memory
bandwidth and matmul rate, the predicted speedup Omega / (gamma * T_D/T_T + T_V/T_T + T_O/T_T), and the critical
sequence length beyond which self-speculation pays.

A step reads every weight once and each sequence's KV once; it takes its bytes over the bandwidth plus its FLOPs over
the matmul rate, plus a fixed cost per layer (kernel launches and latency, which is what dominates small models).
The sum, not the larger of the two: a verification of gamma + 1 tokens at a large batch is neither bandwidth- nor
compute-bound, and the larger of the two missed it, overstating the speedup there; the sum changes little where one
term dominates (results/planner_sweeps). Tensor parallelism divides weights and KV by the number of ranks.

A verification also costs a fixed T_O beyond its gamma draft steps and its target step: the draft's catch-up
bookkeeping, cache rollbacks, acceptance counting, small kernels a plain step never launches. It is not small where
steps are short (a 135M model's); with it and the draft ring's real reads (predict's ring_extra) the model came within
10% of most SmolLM2 points that it missed without them (results/planner_sweeps/cost_model_refit.md).
fit_verify_overhead fits it to a timed verification.

A draft may read its own copy of the weights in 8 or 4 bits (draft_weights.py). What a step's matmuls then take is
not their bytes over the copy bandwidth: each library kernel reaches its own fraction of it, which changes with the
rows M per call (results/draft_weights/probe). The device profile holds that measured time over bf16's per format and
M (weight_kernels); without it, the format's bytes over bf16's stand in (every kernel at copy bandwidth).

Sampled decoding (temperature, top-p) turns every row of logits into probabilities: a softmax and a sort over the
vocabulary per token position per sequence, B rows in a plain step, B * (gamma + 1) in a verification. At a large
batch over a large vocabulary that is a visible part of a step, and more of a verification; left out, the model
overstated sampled speedups where greedy ones held (results/planner_sweeps/cost_model_refit.md). measure_sampling
times it per logit.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from magicdec.model import draft_weights as dw
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Device:
    bandwidth: float  # bytes/s, measured (a device-to-device copy: bytes read + written over time)
    matmul_flops: float  # FLOP/s, measured (a large bf16 matmul)
    layer_overhead_s: float = 0.0  # fixed seconds per layer per step (launches, small kernels)
    ranks: int = 1  # tensor-parallel ranks sharing the work
    # seconds per layer of a forward's all-reduces by ranks (2 per layer, latency-bound at decode sizes), fitted to
    # tensor-parallel records: not in the bytes and FLOPs that divide by the ranks
    collective_s_per_layer: dict = field(default_factory=dict)
    verify_overhead_s: float = 0.0  # fixed seconds per verification beyond its draft and target steps (T_O)
    # fixed seconds a token tree's verification takes beyond a chain's of as many tokens (its mask and positions, the
    # masked attention path) by tensor-parallel ranks, fitted to timed trees (benchmarks/fit_atlas_costs.py)
    tree_verify_s: dict = field(default_factory=dict)
    sampling_s_per_logit: float = 0.0  # sampled decoding: seconds per logit turned into top-p probabilities
    # draft weight format -> {rows M: a step's matmul time over bf16's}, measured (weight_time_ratio)
    weight_kernels: dict = field(default_factory=dict)
    # FLOP/s of attention's matmuls in the decode kernel, fitted to verifications of many tokens (fit_attention_flops);
    # 0: attention's FLOPs at matmul_flops, added to its reads
    attention_flops: float = 0.0
    # a trained head's proposal per drafted level beyond its weights, KV and FLOPs (its small kernels and their
    # launches inside the proposal's graph): seconds by drafter, fitted to a kernel profile (head_cost_check --fit)
    head_level_s: dict = field(default_factory=dict)
    # a head's sampled pick per drafted level, in place of sampling_s_per_logit (whose sort is launch-bound at a
    # head's few rows): {"vocabulary": the whole vocabulary's top-p, "candidates": top-p among its top-K}
    pick_s: dict = field(default_factory=dict)


def weight_bytes(c: ModelArgs, item: int = 2) -> int:
    """Bytes of weights a step reads: every matrix once; the embedding table only as the tied LM head."""
    h, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = c.dim * (h + 2 * kv) + h * c.dim + 3 * c.dim * c.intermediate_size
    return item * (c.n_layers * per_layer + c.vocab_size * c.dim + c.dim * (2 * c.n_layers + 1))  # + RMSNorm weights


def kv_bytes_per_token(c: ModelArgs, item: int = 2) -> int:
    return item * 2 * c.n_layers * c.n_kv_heads * c.head_dim


def step_flops(c: ModelArgs, B: int, context: int, T: int) -> float:
    """Matmul FLOPs of T new tokens for B sequences with `context` cached tokens each (attention's QK and PV)."""
    return 2 * B * T * (weight_bytes(c, 1) + 2 * c.n_layers * c.n_heads * c.head_dim * context)


def weight_time_ratio(c: ModelArgs, d: Device, fmt: str, M: int, group: int = 128) -> float:
    """A step's weight matmuls at M rows in draft weight format `fmt`, over the same in bf16: the device's measured
    ratio (linear in M between measured row counts, the nearest one beyond them), else the format's bytes over
    bf16's. 1 for bf16, and where the run multiplies by the model's own weights (draft_weights.kernel_choices)."""
    if fmt == "bf16" or dw.kernel_choices(fmt, M) == ["full"]:
        return 1.0
    table = d.weight_kernels.get(fmt)
    if table:
        rows = sorted(table, key=int)
        return float(np.interp(M, [int(m) for m in rows], [table[m] for m in rows]))
    shapes = dw.linear_shapes(c).values()
    return sum(dw.format_bytes(N, K, fmt, group) for N, K in shapes) / sum(2 * N * K for N, K in shapes)


def step_time(c: ModelArgs, d: Device, B: int, context: int, T: int = 1, sampled: bool = False,
              kv_per_token: int | None = None, weights: str = "bf16", group: int = 128,
              logit_rows: int | None = None) -> float:
    """Seconds for one forward of T tokens per sequence over `context` cached tokens (`sampled`: and the B * T rows
    of logits turned into probabilities, which every rank does whole); `kv_per_token`: the cache's bytes per token
    where it is not the model's bf16 (a quantized copy); `weights`: a draft's weight format (its matmuls take
    weight_time_ratio of bf16's); `logit_rows`: the rows the LM head (and sampling) runs on where not all B * T (a
    head's forward whose LM head reads one row per sequence)."""
    rows = B * T if logit_rows is None else logit_rows
    lm = c.vocab_size * c.dim
    matmuls = weight_bytes(c) / d.bandwidth + 2 * (B * T * (weight_bytes(c, 1) - lm) + rows * lm) / d.matmul_flops
    reads = B * context * (kv_per_token or kv_bytes_per_token(c)) / d.bandwidth
    attention = step_flops(c, B, context, T) - 2 * B * T * weight_bytes(c, 1)
    # the decode kernel overlaps its dots with its reads: the longer of the two, once its dot rate is measured
    kv = max(reads, attention / d.attention_flops) if d.attention_flops else reads + attention / d.matmul_flops
    return (matmuls * weight_time_ratio(c, d, weights, B * T, group) + kv) / d.ranks \
        + c.n_layers * (d.layer_overhead_s + (d.collective_s_per_layer.get(d.ranks, 0.0) if d.ranks > 1 else 0.0)) \
        + (rows * c.vocab_size * d.sampling_s_per_logit if sampled else 0.0)


def linear_time(d: Device, params: int, rows: int, item: int = 2) -> float:
    """Seconds of `rows` rows through weights of `params` numbers that are no whole model's (a head's ResBlock or LM
    head, EAGLE's fc): as step_time counts a model's weights, read once over the bandwidth plus their FLOPs over the
    matmul rate."""
    return (item * params / d.bandwidth + 2 * rows * params / d.matmul_flops) / d.ranks


def rescale_ranks(measured_s: float, c: ModelArgs, d: Device, B: int, context: int, T: int, ranks_from: int,
                  ranks_to: int) -> float:
    """A step measured on `ranks_from` tensor-parallel ranks, predicted on `ranks_to`: the bytes/FLOPs part divides
    by the ranks; the rest of the measured time (launches, all-reduces, everything the model does not count) is
    kept as it was, which is optimistic where all-reduces grow with the ranks."""
    work = step_time(c, Device(d.bandwidth, d.matmul_flops), B, context, T)
    return work / ranks_to + max(measured_s - work / ranks_from, 0.0)


def omega(alpha: float, gamma: int) -> float:
    """Expected tokens per verification when each drafted token is accepted with probability alpha."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def positions_alpha(positions, alpha: float, gamma: int) -> float:
    """The iid rate that yields what per-position conditional rates yield over gamma drafted tokens (positions past
    the list at alpha)."""
    tokens, reach = 1.0, 1.0
    for i in range(gamma):
        reach *= positions[i] if i < len(positions) else alpha
        tokens += reach
    return chain_alpha(tokens, gamma)


def chain_alpha(tokens: float, gamma: int) -> float:
    """The acceptance rate at which a chain of gamma drafted tokens yields `tokens` per verification (omega's
    inverse): how the planner puts a tree's expected yield into its chain model of finishing times."""
    lo, hi = 0.0, 1.0
    if tokens >= gamma + 1:
        return 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if omega(mid, gamma) < tokens else (lo, mid)
    return (lo + hi) / 2


def predict(target: ModelArgs, d: Device, B: int, prefix: int, gamma: int, alpha: float, budget: int,
            draft: ModelArgs | None = None, ring_extra: int = 0, sampled: bool = False,
            draft_kv_per_token: int | None = None, draft_weights: str = "bf16", draft_group: int = 128,
            tree=None, sibling_rates: tuple[float, ...] = ()) -> dict:
    """Predicted T_T, T_D, T_V and speedup; draft None means self-speculation (the target with a `budget` cache).
    `ring_extra`: the slots a StreamingLLM ring holds beyond its budget for what a forward writes ahead; the draft's
    attention reads them too (masked), which at budget 256 doubles its KV reads. `sampled`: every step also samples
    (the draft its B rows, the verification B * (gamma + 1)). `draft_kv_per_token`: the draft's cache bytes per
    token where not bf16 (QuantSpec's quantized copy of the whole context: budget 0); `draft_weights`: the draft's
    weight format (its group for int4). `tree` (tree.Tree, gamma deep): the verification takes its nodes, and
    yields tree.expected_tokens at alpha for a level's first candidate and `sibling_rates` for the later ones."""
    t_t = step_time(target, d, B, prefix, 1, sampled)
    t_d = step_time(draft or target, d, B, budget + ring_extra if budget else prefix, 1, sampled, draft_kv_per_token,
                    draft_weights, draft_group)
    t_v = step_time(target, d, B, prefix, gamma + 1 if tree is None else tree.size, sampled)
    t_v += 0.0 if tree is None else tree_verify_seconds(d)
    if tree is None:
        tokens = omega(alpha, gamma)
    else:
        from magicdec.model.tree import expected_tokens

        tokens = expected_tokens(tree, (alpha, *sibling_rates))
    p = {"T_T": t_t, "T_D": t_d, "T_V": t_v, "T_O": d.verify_overhead_s, "T_D_over_T_T": t_d / t_t,
         "T_V_over_T_T": t_v / t_t, "T_O_over_T_T": d.verify_overhead_s / t_t, "omega": tokens}
    return p | {"speedup": p["omega"] / verification_cost(p, gamma)}


def selection_seconds(c: ModelArgs, d: Device, B: int, prefix: int, policy) -> float:
    """Seconds to select a draft cache once per prompt (draft_cache.build): the bytes the policy's passes move
    (its selection_bytes) over the bandwidth."""
    return c.n_layers * policy.selection_bytes(c, B, prefix) / d.bandwidth / d.ranks


def refresh_seconds(c: ModelArgs, d: Device, B: int, context: int, policy) -> float:
    """Seconds one --refresh adds: the verification's attention writes its first query's fp32 logits for every query
    head over the cache (after setting them to -inf: 8 bytes each), then the policy's re-selection reads them
    (its refresh_bytes per logit). The gathered kept slots and the top-k are small beside them."""
    logits = B * c.n_heads * context
    return c.n_layers * logits * (8 + policy.refresh_bytes_per_logit) / d.bandwidth / d.ranks


def without_draft_steps(p: dict, gamma: int) -> dict:
    """A prediction for a drafter that runs no draft model (prompt lookup): T_D = 0."""
    return with_draft_step(p, gamma, 0.0)


def with_draft_step(p: dict, gamma: int, seconds: float) -> dict:
    """A prediction whose draft step takes `seconds` (T_D): a drafter whose draft is no model over a cache (a
    trained head)."""
    out = p | {"T_D": seconds, "T_D_over_T_T": seconds / p["T_T"]}
    return out | {"speedup": out["omega"] / verification_cost(out, gamma)}


def with_overhead(p: dict, gamma: int, seconds: float) -> dict:
    """A prediction with `seconds` more fixed cost per verification (T_O)."""
    out = p | {"T_O": p["T_O"] + seconds, "T_O_over_T_T": (p["T_O"] + seconds) / p["T_T"]}
    return out | {"speedup": out["omega"] / verification_cost(out, gamma)}


def offloaded_step_time(c: ModelArgs, d: Device, B: int, context: int, T: int, on_chip: int, host_bandwidth: float,
                        prompt: int | None = None) -> float:
    """Seconds of one forward over a target cache whose layers past `on_chip` keep their prompt KV in host memory
    (offload.OffloadedCache): every offloaded layer's prompt KV crosses the host link once, while the layers compute;
    with the copy overlapped, the step takes the longer of the copy and the on-GPU step (PCIe-bound at long context:
    Llama-2-7B at 128K moves 60 GB per step)."""
    prompt = context if prompt is None else prompt
    copy = (c.n_layers - on_chip) * B * prompt * kv_bytes_per_token(c) / c.n_layers / host_bandwidth
    return max(copy, step_time(c, d, B, context, T))


def tree_verify_seconds(d: Device) -> float:
    """A tree verification's fixed cost beyond a chain's on d's ranks (one GPU's where its ranks were not fitted)."""
    return d.tree_verify_s.get(d.ranks, d.tree_verify_s.get(1, 0.0))


def verification_cost(p: dict, gamma: int) -> float:
    """Seconds of one verification, in target steps: gamma draft steps, the target's (gamma+1)-token step, T_O."""
    return gamma * p["T_D_over_T_T"] + p["T_V_over_T_T"] + p["T_O_over_T_T"]


def critical_length(target: ModelArgs, d: Device, B: int, gamma: int, alpha: float, budget: int,
                    draft: ModelArgs | None = None, limit: int = 1 << 20) -> int | None:
    """Shortest prefix (a multiple of 256) at which speculation is predicted to beat the baseline, or None."""
    prefix = max(budget, 256)
    while prefix <= limit:
        if predict(target, d, B, prefix, gamma, alpha, budget, draft)["speedup"] > 1:
            return prefix
        prefix += 256
    return None


def measure_device(device, dtype=None) -> Device:
    """This device's copy bandwidth and matmul rate, timed here (not datasheet numbers); the fixed cost per layer
    comes from a measured step: see fit_layer_overhead."""
    import torch

    from magicdec.device import copy_bandwidth

    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)

    bandwidth = copy_bandwidth(device)  # the same measure every run record carries
    if bandwidth is None:  # not on a GPU: a smaller copy timed on the wall clock
        src = torch.randn(1 << 24, device=device)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.nbytes / seconds_per_call(lambda: dst.copy_(src), device)
    k = 8192 if cuda else 512
    a, b = torch.randn(k, k, device=device, dtype=dtype), torch.randn(k, k, device=device, dtype=dtype)
    return Device(bandwidth=bandwidth, matmul_flops=2 * k ** 3 / seconds_per_call(lambda: a @ b, device))


def seconds_per_call(fn, device, repeats: int = 20) -> float:
    """fn's seconds per call on `device`: one warm-up call, then `repeats` calls timed together."""
    from magicdec.device import timed

    fn()
    return timed(lambda: [fn() for _ in range(repeats)], device)[1] / repeats


def measure_sampling(device, vocab_size: int, temperature: float, top_p: float, top_k: int = 0, dtype=None,
                     logits: int | None = None) -> float:
    """Seconds per logit of turning rows of logits into top-p probabilities and a draw (sampling.probabilities and
    sample_from), timed on enough rows (`logits` in all: 16M on a GPU, 2M elsewhere) that launches do not count:
    the cost model's sampling_s_per_logit."""
    import torch

    from magicdec.decoding.sampling import next_token

    device = torch.device(device)
    rows = max((logits or (1 << 24 if device.type == "cuda" else 1 << 21)) // vocab_size, 1)
    logits = torch.randn(rows, vocab_size, device=device, dtype=dtype or torch.float32)
    seconds = seconds_per_call(lambda: next_token(logits, temperature, top_p, top_k), device,
                               10 if device.type == "cuda" else 2)
    return seconds / logits.numel()


def fit_verify_overhead(target: ModelArgs, d: Device, B: int, prefix: int, gamma: int, budget: int,
                        draft: ModelArgs | None, verification_s: float, ring_extra: int = 0) -> float:
    """The fixed seconds T_O that make a predicted verification (gamma draft steps plus the target's
    (gamma+1)-token step) take as long as a measured one; d carries the fitted fixed cost per layer already."""
    p = predict(target, replace(d, verify_overhead_s=0.0), B, prefix, gamma, 0.5, budget, draft, ring_extra)
    return max(verification_s - gamma * p["T_D"] - p["T_V"], 0.0)


def fit_attention_flops(c: ModelArgs, d: Device, points, grid=None) -> float:
    """The attention dot rate (Device.attention_flops) that best predicts measured verifications over one decode
    step: `points` are (B, context, T, measured T_V/T_T); least squares on the log of the ratio, over a grid of rates
    (a verification of T tokens reads what a step reads, its attention does T times the dots)."""
    grid = grid if grid is not None else [r * 1e12 for r in range(20, 801, 5)]

    def misfit(rate):
        e = replace(d, attention_flops=rate)
        return sum(math.log(step_time(c, e, B, ctx, T) / step_time(c, e, B, ctx, 1) / ratio) ** 2
                   for B, ctx, T, ratio in points)
    return float(min(grid, key=misfit))


def fit_layer_overhead(c: ModelArgs, d: Device, B: int, context: int, step_s: float) -> float:
    """The fixed seconds per layer that make step_time(c, d, B, context) equal a measured plain decode step: what a
    layer's launches and small kernels cost beyond its bytes and FLOPs. Measured where they weigh most (B = 1, a
    short context). Counting kernels and timing a tiny one instead varied several-fold from run to run on one H100
    (the count caught compilation's kernels on some runs), and even the low count missed most of the real cost."""
    work = step_time(c, replace(d, layer_overhead_s=0.0), B, context)
    return max(step_s - work, 0.0) / c.n_layers


def committed_profile_path(gpu: str | None) -> Path | None:
    """Where the committed device profile (PROFILES) of this GPU model is, or None."""
    for path in sorted(PROFILES.glob("*.json")):
        if gpu and json.loads(path.read_text()).get("device") == gpu:
            return path
    return None


def device_profile_path(gpu: str | None) -> Path:
    """This GPU model's committed profile, else the H100's: the one rule by which a plan and a sweep's own cost model
    find a device's costs (said once per process where there is none: its costs are not this GPU's)."""
    found = committed_profile_path(gpu)
    if found is None:
        say_no_profile(gpu or "this device")
    return found or PROFILES / "h100.json"


def device_profile(gpu: str | None) -> dict:
    """The profile device_profile_path finds, read as load_profile reads it (a broken one: its one-line error)."""
    return load_profile(device_profile_path(gpu))[2]


@functools.cache
def say_no_profile(device: str) -> None:
    """Once per process (a sweep plans many points, each rank of a tensor-parallel run its own)."""
    print(f"note: no committed device profile for {device}: its costs are taken from the H100's "
          f"({PROFILES / 'h100.json'}); make one from a sweep run here with benchmarks/derive_profile.py",
          file=sys.stderr)


def by_ranks(profile: dict, key: str) -> dict:
    """A profile's table by tensor-parallel ranks ({ranks: seconds}; JSON keys are strings): tree_verify_s,
    collective_s_per_layer."""
    return {int(k): float(v) for k, v in (profile.get(key) or {}).items()}


def head_costs_of(profile: dict) -> dict:
    """A profile's fitted head terms as Device fields (head_level_s, pick_s; empty where it has none)."""
    return {k: dict(profile.get(k) or {}) for k in ("head_level_s", "pick_s")}


def load_profile(path: Path, flag: str = "--profile") -> tuple[Device, dict, dict]:
    """(the profiled device, its fixed cost per verification by drafter, what the profile says of itself); a file
    that is no profile, one line naming `flag`."""
    try:
        p = json.loads(Path(path).read_text())
        device = Device(p["bandwidth"], p["matmul_flops"], p.get("layer_overhead_s", 0.0),
                        sampling_s_per_logit=p.get("sampling_s_per_logit", 0.0),
                        weight_kernels=weight_kernels_of(p), attention_flops=p.get("attention_flops", 0.0),
                        tree_verify_s=by_ranks(p, "tree_verify_s"),
                        collective_s_per_layer=by_ranks(p, "collective_s_per_layer"), **head_costs_of(p))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise MagicDecError(f"{flag} {path}: cannot read it as a device profile ({type(e).__name__}: {e}); give a "
                            f"profile such as {PROFILES / 'h100.json'}") from None
    return device, p.get("verify_overhead_s", {}), p


def measured_here(profile: dict, terms: list[str]) -> dict:
    """A profile after `terms` were measured on its own GPU (a whole term by name, a part as `term[key]`): where the
    profile was derived from another GPU's (benchmarks/derive_profile.py), a whole term leaves the list of copied
    ones and every one is listed as measured here."""
    derived = profile.get("derived_from")
    if not derived:
        return profile
    copied = [t for t in derived.get("terms", []) if t not in terms]
    here = sorted(set(derived.get("measured_here", [])) | set(terms))
    return profile | {"derived_from": derived | {"terms": copied, "measured_here": here}}


def weight_kernels_of(profile: dict) -> dict:
    """A profile's weight kernel table with integer row counts."""
    table = (profile.get("weight_kernels") or {}).get("matmul_time_vs_bf16") or {}
    return {fmt: {int(m): float(r) for m, r in by_m.items()} for fmt, by_m in table.items()}
