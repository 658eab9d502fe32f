"""Acceptance: how many drafted tokens a verification keeps, per sequence, and the token that follows them. One
`Acceptor` per decoder serves every drafter, chain or tree (as vLLM's one rejection sampler serves every proposer).

Every rule takes the target's verification output for the root (the last committed token) and the drafted tokens
and returns (accepted [B], next [B]): sequence b keeps its drafted[b, :accepted[b]] (a tree: the nodes of its
accepted path) and then `next[b]`, so it advances by accepted + 1 tokens.

Exact acceptance keeps the target's own output. Greedy keeps the drafted tokens equal to the target's argmax (a tree:
the child equal to the target's argmax at its parent, the longest matching path): the output is plain greedy
decoding. Sampling is lossless: a chain by speculative sampling; a tree by trying a node's children in order
(SpecInfer's multi-candidate rule, in Sequoia's form for candidates drawn without replacement): child c, proposed
from q_c, is kept with probability min(1, p(c) / q_c(c)); after a rejection p becomes norm(max(0, p - q_c)) and the
next child is tried against it; after the last rejection, the next token is drawn from what p has become. Every step
keeps the output distributed exactly as the target's own sampling. A deterministic candidate (a greedy draft's
top-k) has q_c = one-hot at c: rejecting it zeroes c in p.

Synthetic acceptance (random-weight speed runs: the real kernel work at a chosen acceptance) keeps a drafted token
when a uniform number drawn for it is below a rate: the same rate everywhere (iid), a rate per drafted position of a
verification (vLLM's convention), a rate per sibling rank in a tree (Sequoia's acceptance vector), or a recorded
run's acceptance replayed. A chain's numbers are one landscape per generation (acceptance_landscape); a tree's are
drawn per node and verification from a generator seeded once per generation. A new synthetic mode is a field of
`SyntheticAcceptor` (and its option in run_config.Speculation, read in `Acceptor.from_config`).
"""
from __future__ import annotations

import functools
import math
import json
from pathlib import Path

import torch

from magicdec.errors import MagicDecError
from magicdec.decoding.sampling import Sampling, sample_from
from magicdec.model.tree import TreeOnDevice

SYNTHETIC_DRAWS = "one uniform per (sequence, position), the same for every gamma (acceptance.acceptance_landscape)"


def record_fields(speculation) -> dict:
    """What a run's record says of a synthetic acceptance (None where the target's own comparison decided)."""
    rate = speculation.synthetic_acceptance
    return {"synthetic_acceptance": rate, "synthetic_draws": SYNTHETIC_DRAWS if rate is not None else None}


def source_label(config: dict) -> str | None:
    """Where a run's acceptance came from, read from its record's config: a replayed trace, or synthetic rates (iid,
    per tree sibling, per position, the hierarchy's two levels); None: the target compared the drafted tokens."""
    rate = config.get("synthetic_acceptance")
    if config.get("acceptance_trace"):
        return f"replayed trace ({config['acceptance_trace']})"
    if rate is None:
        return None
    if config.get("synthetic_siblings"):
        later = " / ".join(f"{x:g}" for x in config["synthetic_siblings"])
        label = f"synthetic per tree level: α {rate:g} for a level's first candidate, {later} for later ones"
        if config.get("synthetic_sequence_factors"):
            label += ", per sequence × " + " / ".join(f"{x:.2f}" for x in config["synthetic_sequence_factors"])
    elif config.get("synthetic_positions"):
        label = "synthetic per position: α " + " / ".join(f"{x:g}" for x in config["synthetic_positions"])
    else:
        label = f"synthetic, iid α {rate:g}"
    if config.get("synthetic_bottom") is not None:
        label += f" (middle → target), {config['synthetic_bottom']:g} (bottom → middle)"
    return label


class Acceptor:
    """Exact acceptance (module docstring), greedy or sampled as `sampling` says. The loop calls `begin` once per
    generation and, per verification, `draws` (what acceptance draws outside a CUDA graph) and `accept`, a function
    of tensors only, so that a tree's acceptance and the move of its path's KV replay as one graph."""

    def __init__(self, sampling: Sampling | None = None):
        self.sampling = Sampling() if sampling is None else sampling
        self.seed = 0  # a synthetic mode's draws; a decoder run many times (a hierarchy's middle level) bumps it

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    @staticmethod
    def from_config(decoding, speculation=None) -> Acceptor:
        """The acceptor a run's config asks for: its decoding section's sampling, and the synthetic mode its
        speculation section sets (None: nothing is drafted, a baseline, so acceptance is exact)."""
        sampling = Sampling(decoding.temperature, decoding.top_p, decoding.top_k)
        s = speculation
        if s is None or s.synthetic_acceptance is None:
            return Acceptor(sampling)
        replay = load_trace(s.acceptance_trace) if s.acceptance_trace else None
        return SyntheticAcceptor(sampling, s.synthetic_acceptance, s.synthetic_positions, s.synthetic_siblings, replay,
                                 s.synthetic_sequence_factors)

    def begin(self, B: int, length: int, device) -> None:
        """A generation of B sequences starts; its committed tokens take `length` columns (generate.Batch.hist)."""

    def draws(self, batch, tokens: torch.Tensor, tree: TreeOnDevice | None):
        """What this verification's acceptance draws before it runs (None here: exact acceptance draws inside)."""
        return None

    def accept(self, verified: torch.Tensor, tokens: torch.Tensor, q, tree: TreeOnDevice | None, draws):
        """verified: the target's argmax ids [B, T] (greedy) or probabilities [B, T, V] at the root and each drafted
        token; tokens [B, T]: the root then the drafted tokens (a chain's, or a tree's nodes); q: the draft's
        distributions [B, T - 1, V] at the drafted tokens (None: greedy, or every candidate deterministic). Returns
        (accepted [B], next [B], a tree's accepted path of nodes [B, D + 1] or None for a chain)."""
        if tree is None:
            drafted = tokens[:, 1:]
            if verified.dim() == 2:
                return *greedy_verify(verified, drafted), None
            return *speculative_sampling_verify(verified, verified[:, :0] if q is None else q, drafted), None
        if verified.dim() == 2:
            path, accepted, nxt = greedy_tree_verify(verified, tokens, tree)
        else:
            q = None if q is None else torch.cat([q[:, :1], q], 1)  # the root's row, unread
            path, accepted, nxt = sampling_tree_verify(verified, q, tokens, tree)
        return accepted, nxt, path


class SyntheticAcceptor(Acceptor):
    """Synthetic acceptance (module docstring): a drafted token of a chain is kept iff the landscape's number at its
    position is below `rate` (or `positions`' rate for its place in the verification, `rate` past them); `replay` (a
    recorded trace, run_config.load_trace) draws the landscape that replays it; a tree's candidate of sibling rank r
    is kept iff its draw is below (rate, *siblings)[r] (the last for every rank past them). Sampled, a chain's work is
    a sampled run's (the next token drawn as the lossless rule draws it), its acceptance the draws'."""

    def __init__(self, sampling: Sampling | None, rate: float, positions: tuple[float, ...] = (),
                 siblings: tuple[float, ...] = (), replay: dict | None = None, factors: tuple[float, ...] = ()):
        super().__init__(sampling)
        self.rate, self.positions, self.siblings, self.replay = rate, tuple(positions), tuple(siblings), replay
        self.factors = tuple(factors)  # a tree's per-sequence scale of its rates (sequence b: factors[b mod S])

    @property
    def tree_rates(self) -> tuple[float, ...]:
        return (self.rate, *self.siblings)

    def begin(self, B: int, length: int, device) -> None:
        if self.replay is not None:
            self.landscape = trace_landscape(self.replay["gammas"], self.replay["accepted"], B, length, self.rate,
                                             device, self.seed)
        else:
            self.landscape = acceptance_landscape(B, length, device, self.seed)
        self.tree_draws = torch.Generator(device=device).manual_seed(self.seed)  # a tree's per-node draws
        # kept iff draw < rate * factor, i.e. draw / factor < rate: the draws are divided (a factor 0: never kept)
        self.tree_scale = None if not self.factors else torch.tensor(
            [1 / f if f > 0 else math.inf for f in (self.factors[b % len(self.factors)] for b in range(B))],
            device=device)[:, None]

    def draws(self, batch, tokens: torch.Tensor, tree: TreeOnDevice | None) -> torch.Tensor:
        """A chain's: the landscape at the hist columns its drafted tokens take (stopped rows read inside it); a
        tree's: one fresh number per node (in a CUDA graph a generator would replay the same numbers)."""
        if tree is None:
            return self.landscape.gather(1, batch.drafted_columns(tokens.shape[1] - 1))
        if not self.greedy:
            raise MagicDecError("--synthetic_acceptance with --temperature: a tree's sampled acceptance has no "
                                "synthetic form; drop --temperature for a tree drafter")
        draws = torch.rand(tokens.shape, device=tokens.device, generator=self.tree_draws)
        node_rates(tree, self.tree_rates, self.positions)  # made before any capture reads it
        return draws if self.tree_scale is None else draws * self.tree_scale

    def accept(self, verified: torch.Tensor, tokens: torch.Tensor, q, tree: TreeOnDevice | None, draws):
        if tree is not None:  # per-position rates, where given, are a tree's first candidates' per level
            path, accepted, nxt = synthetic_tree_verify(verified, tree, self.tree_rates, draws, self.positions)
            return accepted, nxt, path
        drafted = tokens[:, 1:]
        rate = position_rates(self.positions, self.rate, drafted.shape[1], str(drafted.device)) \
            if self.positions else self.rate
        if verified.dim() == 3:  # sampled: the sampling's work as a real run does it, the coin flips' acceptance
            return *speculative_sampling_verify(verified, verified[:, :0] if q is None else q, drafted,
                                                keep=draws < rate), None
        return *synthetic_verify(verified, drafted, rate, draws), None


def load_trace(path: Path) -> dict:
    """A record's acceptance trace ({"gammas": [...], "accepted": [[per sequence] per verification]}), transposed
    to one list per sequence; a one-line error for a file that is not a record with one."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MagicDecError(f"--acceptance_trace {path}: cannot read it as a JSON record ({e})") from None
    trace = record.get("acceptance_trace") if isinstance(record, dict) else None
    if not isinstance(trace, dict) or not trace.get("accepted") or not trace.get("gammas"):
        raise MagicDecError(f"--acceptance_trace {path}: the record has no acceptance trace: make it with a "
                            "speculative run's --save_trace")
    return {"gammas": list(trace["gammas"]), "accepted": [list(s) for s in zip(*trace["accepted"])]}


# --- chains ---------------------------------------------------------------------------------------------------------
def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of leading True values in each row of a [B, gamma] bool tensor."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(best: torch.Tensor, drafted: torch.Tensor):
    """best [B, gamma+1]: the target's argmax at each verified position. Keep drafted tokens while they equal it;
    then the target's own argmax (the bonus token when all are kept). Output equals plain greedy decoding."""
    accepted = leading_true(best[:, :-1] == drafted)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


def speculative_sampling_verify(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, correct: bool = True,
                                keep: torch.Tensor | None = None):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    p [B, gamma+1, V]: target probabilities at each verified position; q [B, gamma, V]: the draft's probabilities
    that drafted [B, gamma] was sampled from. Token i is kept with probability min(1, p/q); at the first rejection
    the next token is drawn from norm(max(0, p - q)), after full acceptance from p (the bonus). The result is
    distributed exactly as sampling from p. `correct=False` draws from p instead of the residual after a rejection:
    that is NOT lossless, and exists so a test can show the statistical test catches it. `keep` [B, gamma] bool:
    which drafted tokens pass, decided elsewhere (synthetic acceptance of a sampled random-weight run: the same work,
    the acceptance of its coin flips).
    """
    B, gamma = drafted.shape
    p_d = p[:, :gamma].gather(-1, drafted[..., None])[..., 0]
    q_d = q.gather(-1, drafted[..., None])[..., 0]
    passed = torch.rand_like(p_d) * q_d < p_d  # u < p/q without dividing
    keep = passed if keep is None else keep
    accepted = leading_true(keep)
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, accepted]
    if correct:
        q_next = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)[rows, accepted]  # zeros: the bonus uses p alone
        residual = torch.clamp(p_next - q_next, min=0)
        mass = residual.sum(-1, keepdim=True)
        p_next = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # mass 0 only if p == q
    return accepted, sample_from(p_next)


def acceptance_landscape(B: int, length: int, device, seed: int = 0) -> torch.Tensor:
    """For synthetic acceptance: one uniform number per (sequence, position), drawn once per generation from its own
    seeded generator. A drafted token at position t of sequence b is accepted iff landscape[b, t] < alpha, so every
    gamma (and the planner's per-verification choices) meets the same easy and hard positions, as it would on real
    text: comparisons across gamma are then free of the luck of separate draws (common random numbers)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    # drawn position-major, so position t gets the same numbers however long the landscape (gamma sets its length)
    return torch.rand(length, B, generator=generator, device=device).T.contiguous()


@functools.lru_cache(maxsize=64)
def position_rates(rates: tuple[float, ...], alpha: float, gamma: int, device: str) -> torch.Tensor:
    """[gamma]: the conditional rate of each drafted position of a verification (--synthetic_positions), `alpha`
    past the ones given; made once (a copy from the host each verification would wait for the GPU)."""
    return torch.tensor([rates[i] if i < len(rates) else alpha for i in range(gamma)], device=device)


def trace_landscape(gammas: list[int], accepted: list[list[int]], B: int, length: int, alpha: float, device,
                    seed: int = 0) -> torch.Tensor:
    """A landscape (acceptance_landscape's [B, length], read against `alpha`) that replays a recorded run: sequence
    b follows the trace's sequence b % S verification by verification, its accepted drafts at 0 (kept at any rate),
    the draft that was rejected at 1 (never kept); the positions the trace leaves open (the one after a fully kept
    draft, those past its end) are drawn so that they are kept at that sequence's own rate in the trace. At the
    recorded gammas the replay keeps exactly the recorded counts; at others it keeps each sequence's own
    per-position pattern, rate and spread from the others."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.rand(length, B, generator=gen).T.contiguous()
    for b in range(B):
        seq = [(g, a) for g, a in zip(gammas, accepted[b % len(accepted)]) if a >= 0]
        examined = sum(min(a + 1, g) for g, a in seq)
        own = sum(a for _, a in seq) / examined if examined else 0.0
        out[b] = out[b] * alpha / own if own > 0 else 1.0
        col = 2  # hist column of the first drafted token (generate.Batch)
        for g, a in seq:
            out[b, col:min(col + a, length)] = 0.0
            if a < g and col + a < length:
                out[b, col + a] = 1.0
            col += a + 1
            if col >= length:
                break
    return out.to(device)


def synthetic_verify(best: torch.Tensor, drafted: torch.Tensor, alpha, uniforms: torch.Tensor | None = None):
    """For random-weight speed runs: keep each drafted token with probability alpha, so the real kernel work happens
    at a chosen acceptance rate; alpha a number, or a [gamma] tensor of per-position conditional rates (the drafted
    token at position i kept with alpha[i] once those before it were). `uniforms` [B, gamma]: the landscape at the
    drafted positions (fresh draws from torch's seeded generator if None). The next token is the target's argmax."""
    if uniforms is None:
        uniforms = torch.rand(drafted.shape, device=drafted.device)
    accepted = leading_true(uniforms < alpha)
    return accepted, best.gather(1, accepted[:, None])[:, 0]


# --- trees (tree.Tree: node 0 the root, every node's parent before it) ------------------------------------------------
def greedy_tree_verify(best: torch.Tensor, tokens: torch.Tensor, tree: TreeOnDevice):
    """best [B, N]: the target's argmax at each node; tokens [B, N]: the nodes' tokens (the root's unused). Keep the
    deepest node whose every ancestor, itself included, equals the target's argmax at its parent. Returns (path
    [B, D + 1] node indices from the root, padded with the last kept node; accepted [B] drafted tokens kept; next
    [B], the target's argmax after them)."""
    match = tokens == best.gather(1, tree.parents[None].expand_as(tokens))
    match[:, 0] = True
    kept = ~((~match)[:, None, :] & tree.ancestors[None]).any(-1)  # no failing node on the way from the root
    depth = torch.where(kept, tree.depths[None], -1)
    last = depth.argmax(1)  # the deepest kept node (the first of equal depth)
    return tree.path_to(last), depth.max(1).values, best.gather(1, last[:, None])[:, 0]


def sampling_tree_verify(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, tree: TreeOnDevice,
                         correct: bool = True):
    """p [B, N, V]: the target's probabilities at each node; q [B, N, V]: the distribution each node's token was
    proposed from (None: every candidate deterministic, a one-hot at its token); tokens [B, N]. Walks from the
    root, trying each node's children in order (module docstring). `correct=False` leaves p as it was after a
    rejection: NOT lossless (the test that catches it). Returns (path, accepted, next) as greedy_tree_verify.

    The residual is kept unnormalized beside its mass: rejecting a deterministic candidate then zeroes one id (no
    pass over the vocabulary per child tried), and a sequence that keeps a child takes that child's p once, at the
    end of the level (it tries no more children of this level)."""
    B, N, V = p.shape
    rows = torch.arange(B, device=p.device)
    at = torch.zeros(B, dtype=torch.long, device=p.device)  # the node each sequence stands on
    done = torch.zeros(B, dtype=torch.bool, device=p.device)  # no child kept at `at`: its next token is drawn
    residual = p[:, 0].clone()
    mass = torch.ones(B, dtype=p.dtype, device=p.device)  # residual's sum
    t = tree.tree
    for d in range(t.depth):
        moved = torch.zeros_like(done)
        for r in range(t.level_widths[d]):  # the r-th child of the node each sequence stands on
            child = tree.children[at, r]
            trying = ~done & ~moved & (child >= 0)
            c = child.clamp(min=0)
            tok = tokens[rows, c]
            p_tok = residual[rows, tok]
            q_tok = 1.0 if q is None else q[rows, c, tok]
            keep = trying & (torch.rand(B, device=p.device) * q_tok * mass < p_tok)
            rejected = trying & ~keep
            if correct and q is None:  # residual - one-hot, clamped: the token's probability gone
                residual.scatter_(1, tok[:, None], torch.where(rejected, 0.0, p_tok)[:, None])
                mass = torch.where(rejected, mass - p_tok, mass)
            elif correct:
                left = torch.clamp(residual / mass[:, None] - q[rows, c], min=0)
                left_mass = left.sum(-1)
                update = rejected & (left_mass > 0)
                residual = torch.where(update[:, None], left, residual)
                mass = torch.where(update, left_mass, mass)
            at = torch.where(keep, c, at)
            moved |= keep
        residual = torch.where(moved[:, None], p[rows, at], residual)
        mass = torch.where(moved, 1.0, mass)
        done |= ~moved
    return tree.path_to(at), tree.depths[at], sample_from(residual)


def synthetic_tree_verify(best: torch.Tensor, tree: TreeOnDevice, rates: tuple[float, ...], uniforms: torch.Tensor,
                          levels: tuple[float, ...] = ()):
    """For random-weight speed runs: from the root, each node's children are tried in order and the one of rank r
    is kept with probability rates[r] (the last rate for every rank past it) once the ones before it were not, as
    Sequoia's acceptance vector says; `levels`: a first child at depth d takes levels[d - 1] instead of rates[0]
    (a drafter measured per level, Lookahead); uniforms [B, N] one draw per node. Returns (path, accepted, next),
    next the target's argmax at the last kept node."""
    B = best.shape[0]
    rate = node_rates(tree, tuple(rates), tuple(levels))
    at = torch.zeros(B, dtype=torch.long, device=best.device)
    for d in range(tree.tree.depth):
        moved = torch.zeros(B, dtype=torch.bool, device=best.device)
        for r in range(tree.tree.level_widths[d]):
            child = tree.children[at, r]
            c = child.clamp(min=0)
            keep = ~moved & (child >= 0) & (uniforms.gather(1, c[:, None])[:, 0] < rate[c])
            at = torch.where(keep, c, at)
            moved |= keep
    return tree.path_to(at), tree.depths[at], best.gather(1, at[:, None])[:, 0]


@functools.lru_cache(maxsize=64)
def node_rates(tree: TreeOnDevice, rates: tuple[float, ...], levels: tuple[float, ...] = ()) -> torch.Tensor:
    """[N]: each node's acceptance rate by its sibling rank (a first child by its depth where `levels` are given:
    synthetic_tree_verify), made once: a copy from the host at every verification waits for the GPU, and the walk's
    launches then run on an idle GPU."""
    out = torch.tensor(rates, device=tree.rank.device)[tree.rank.clamp(max=len(rates) - 1)]
    if levels:
        by_depth = torch.tensor((rates[0], *levels), device=tree.rank.device)
        first = by_depth[tree.depths.clamp(max=len(levels))]
        out = torch.where((tree.rank == 0) & (tree.depths > 0), first, out)
    return out
