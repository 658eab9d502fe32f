"""Prefill, and the one generation loop every method runs: draft gamma tokens, verify gamma+1 in one target pass,
keep a per-sequence number of them, commit them, roll the target's cache back past what was rejected. The baseline is
this loop with no draft (gamma = 0: a plain decode step). `Decoder.generate` is that loop; the batch's committed
tokens (`Batch`), the choice of gamma (`GammaSchedule`), the counts (`stats.Counts`) and the progress bar are small
helpers beside it."""
from __future__ import annotations

import copy
import gc
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from magicdec.model import tp
from magicdec.decoding.acceptance import Acceptor
from magicdec.model.forward_plan import PLAIN, ForwardPlan, prefill_chunk
from magicdec.model.transformer import Transformer
from magicdec.decoding.sampling import Sampling, probabilities
from magicdec.decoding.stats import Counts, PhaseTimer, Stats
from magicdec.model.tree import path_tokens, rank_counts

if TYPE_CHECKING:  # the loop asks a policy for gamma; the planner that makes one sits above the loop
    from magicdec.analysis.planner import AutoGamma


def prefill(model: Transformer, cache, prompts: torch.Tensor, chunk: int, progress: bool = False,
            desc: str = "prefill (target)") -> torch.Tensor:
    """Feed prompts [B, P] in chunks of `chunk` tokens per sequence; return the last position's logits [B, V].

    Chunking bounds activation memory for 100K-token prompts: only the final chunk computes logits, and only
    for its last position.
    """
    B, P = prompts.shape
    logits = None
    for start in tqdm(range(0, P, chunk), desc=desc, disable=not progress, leave=False):
        piece = prompts[:, start:start + chunk]
        logits = model(piece, cache, prefill_chunk(last=start + chunk >= P))
        cache.advance(piece.shape[1])
    return logits[:, -1]


def prefill_features(model: Transformer, cache, prompts: torch.Tensor, chunk: int, taps: tuple[int, ...],
                     keep: torch.Tensor | None = None, progress: bool = False, desc: str = "prefill (target)"):
    """prefill() that also keeps the target's hidden states `taps` (heads.py) at the prompt positions `keep` (an
    ascending [n] tensor; None: every position) for a head: (last logits [B, V], features [B, n, F]). Only the
    kept rows are held, so a window's features cost a window, not the prompt."""
    from magicdec.model.forward_plan import FeatureRequest

    B, P = prompts.shape
    keep = torch.arange(P, device=prompts.device) if keep is None else keep.to(prompts.device)
    width = sum(model.args.dim for _ in taps)
    dtype = model.tok_embeddings.weight.dtype
    out = torch.empty(B, keep.numel(), width, dtype=dtype, device=prompts.device)
    request = FeatureRequest(tuple(taps), torch.empty(B, min(chunk, P), width, dtype=dtype, device=prompts.device))
    logits = None
    for start in tqdm(range(0, P, chunk), desc=desc, disable=not progress, leave=False):
        piece = prompts[:, start:start + chunk]
        logits = model(piece, cache, replace(prefill_chunk(last=start + chunk >= P), features=request))
        cache.advance(piece.shape[1])
        rows = ((keep >= start) & (keep < start + piece.shape[1])).nonzero()[:, 0]
        out[:, rows] = request.out[:, keep[rows] - start]
    return logits[:, -1], out


class Drafter:
    """What the loop asks of whatever drafts (each kind is a module of magicdec/drafters/): gamma proposed tokens
    per verification, and hooks around each verification. The defaults do nothing, so a drafter implements only
    what it needs.

    `propose(step, hist, m, start, gamma)`: up to gamma tokens per sequence following its committed tokens
    hist[:, :m] ([B, n], n <= gamma: a drafter may propose fewer) and the distributions q [B, n, V] they were
    sampled from (None when greedy or deterministic); `step(model, tokens, cache, plan)` is the decoder's draft step
    (graphed or compiled as the run's step mode says): with forward_plan.LAST_LOGITS argmax ids [B] (above width 1
    the `width` likeliest [B, width]), or probabilities [B, V], at the last position; with a plan drafting a tree
    level (ForwardPlan.drafting) the same at every node of the level; `start` [B] is the target cache position of
    hist[:, m - 2].

    A drafter is prepared once and then serves decoders of any width and tree shape: `shaped(width, shape)` is the
    copy a decoder runs, the prepared drafter unchanged."""

    # True where a run meets CUDA-graph shapes that only a whole run meets: a verification's length that varies from
    # one to the next (prompt lookup), or a graph over the history buffer, whose width is the run's length (lookup's
    # proposal, a head's). Timing then warms up over a whole run, so that no capture lands in a timed one
    whole_run_warm_up = False
    # candidates per drafted position (--tree_width): above 1 a drafter proposes a token tree (tree_for), and a
    # greedy draft step returns the draft's `width` likeliest ids [B, width] instead of its argmax
    width = 1
    shape = None  # a token tree (tree.Tree, in level order) a drafter drafts level by level (--tree_nodes), or None

    def shaped(self, width: int, shape=None) -> "Drafter":
        """A shallow copy drafting `width` candidates per position, or the tree `shape` (its draft steps' candidates
        then the most children a node has): what a decoder runs, so the prepared drafter serves every point."""
        drafter = copy.copy(self)
        drafter.width, drafter.shape = (width if shape is None else shape.max_children), shape
        return drafter

    def tree_for(self, tokens: int):
        """The token tree (tree.Tree) a proposal of `tokens` drafted tokens fills, in node order after the root;
        None: they are a chain."""
        return None

    def begin(self) -> None:
        """A generation starts (each timed run starts alike)."""

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        raise NotImplementedError

    def verify_plan(self, cache, gamma: int) -> ForwardPlan:
        """Just before the target verifies `gamma` drafted tokens over `cache`: the plan of that forward
        (forward_plan.ForwardPlan), where a drafter asks it for a side output (a head's hidden states, a refresh's
        attention scores); the loop adds the tree it verifies."""
        return PLAIN

    def after_verify(self, verified: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """The target's pass over the proposal, before its tokens are committed: argmax ids [B, T] or
        probabilities [B, T, V] at every verified position (a tree's nodes in node order; Lookahead's Jacobi
        window reads its next iteration there), and a tree's accepted path of nodes [B, D + 1] (None: a chain)."""

    def after_commit(self, cache) -> None:
        """After the accepted tokens are committed and the target's cache rolled back past the rejected ones."""

    def summary(self) -> dict | None:
        """The drafter's own numbers since begin() (the record's metrics.speculation.drafter), or None."""
        return None


def capture(fn, pool=None, warm_up: bool = True):
    """fn() run once eagerly on a side stream (warm-up: its real work), then captured into a CUDA graph; returns the
    graph and what the captured fn() returned (its static output, overwritten by each replay). `warm_up` False:
    captured without running first (for a step that must not run twice: its replay follows)."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Python's garbage collector must not run inside a capture: collecting an old Decoder (a reference cycle)
    # destroys its graphs, which CUDA forbids while a stream captures, and the capture is invalidated.
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        gc.enable()
    return graph, out


class GraphedStep:
    """Replays a CUDA graph of `fn(*args)`, captured on first use for each key: the tensor arguments' shapes, the
    other arguments' values (ints), keys (a forward_plan.ForwardPlan's) or identities (a cache), and `key(*args)`
    for what else changes the work.

    Small models and short contexts are bound by kernel launches; a graph removes them. Capture costs one eager
    step, where torch.compile (`--compile`) also fuses kernels but compiles for minutes per new shape — too slow
    for sweeps over many batch sizes. The warm-up and capture write the same KV the real step writes next. Tensor
    arguments are copied into the graph's static inputs before each replay; the output is the graph's static
    output, overwritten by the next replay. `warm_up` False: no eager run before the capture, for a step that is not
    idempotent (moving a tree's accepted KV); it must need no lazy setup (no cuBLAS, no copy from the host).
    """

    def __init__(self, fn, key=lambda *args: (), warm_up: bool = True):
        self.fn, self.key, self.graphs, self.pool, self.warm_up = fn, key, {}, None, warm_up

    def __call__(self, *args):
        k = tuple(a.shape if torch.is_tensor(a) else a if isinstance(a, int) else
                  a.key if isinstance(a, ForwardPlan) else id(a) for a in args)
        k += tuple(self.key(*args))
        if k not in self.graphs:
            static = [a.clone() if torch.is_tensor(a) else a for a in args]
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            graph, static_out = capture(lambda: self.fn(*static), self.pool, self.warm_up)
            self.graphs[k] = (graph, static, static_out, args)  # holding the args keeps their ids unique
        graph, static, static_out, _ = self.graphs[k]
        for s, a in zip(static, args):
            if torch.is_tensor(a):
                s.copy_(a)
        graph.replay()
        return static_out


class Batch:
    """The committed tokens of a batch being generated: hist[:, i] is the token at target cache position base + i
    (column 0 the prompt's last token, column 1 the one sampled from the prefill logits), m [B] the committed count
    per sequence, done [B] the sequences stopped at EOS or at n_new tokens. Stopped rows stay in the tensors (fixed
    shapes: no host sync, CUDA graphs) and every index into them is clamped inside."""

    def __init__(self, first: torch.Tensor, prev: torch.Tensor | None, n_new: int, gamma: int, eos_ids, base):
        B, dev = first.shape[0], first.device
        self.hist = torch.zeros(B, n_new + gamma + 3, dtype=torch.long, device=dev)
        self.hist[:, 0] = first if prev is None else prev
        self.hist[:, 1] = first
        self.m = torch.full((B,), 2, dtype=torch.long, device=dev)
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.done = torch.isin(first, self.eos) | (n_new <= 1)
        self.cols = torch.arange(gamma + 1, device=dev)
        self.base, self.n_new = base, n_new

    def position(self, back: int) -> torch.Tensor:
        """Target cache position of hist[:, m - back] (a stopped row's kept inside the cache)."""
        return self.base + torch.clamp(self.m, max=self.n_new + 1) - back

    def drafted_columns(self, gamma: int) -> torch.Tensor:
        """[B, gamma]: the hist columns the next gamma drafted tokens take (where an acceptor's landscape is read)."""
        return torch.clamp(self.m, max=self.n_new)[:, None] + self.cols[None, :gamma]

    def commit(self, drafted: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """Append drafted[:accepted] + nxt to each active sequence, stopping it at EOS or n_new; returns the rows
        that were active."""
        cols = self.cols[:drafted.shape[1] + 1]
        active = ~self.done
        new = torch.cat([drafted, nxt[:, None]], 1)
        new.scatter_(1, accepted[:, None], nxt[:, None])
        take = (cols[None] <= accepted[:, None]) & active[:, None]
        idx = torch.clamp(self.m, max=self.n_new)[:, None] + cols[None]  # active rows have m <= n_new
        self.hist.scatter_(1, idx, torch.where(take, new, self.hist.gather(1, idx)))
        is_eos = torch.isin(new, self.eos) & take
        hit = is_eos.any(1)
        n_kept = torch.where(hit, is_eos.long().argmax(1), accepted) + 1
        self.m = torch.where(active, self.m + n_kept, self.m)
        self.done = self.done | hit | (self.m - 1 >= self.n_new)
        return active

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, n_new] and the count of tokens each sequence produced (EOS included); positions after a sequence
        stopped repeat its last token."""
        count = torch.clamp(self.m - 1, max=self.n_new)
        cols = torch.minimum(torch.arange(self.n_new, device=count.device)[None], count[:, None] - 1)
        return self.hist[:, 1:].gather(1, cols), count


class GammaSchedule:
    """gamma for each verification: the decoder's own, or its policy's (--gamma auto, planner.AutoGamma).

    The policy chooses on the host while the GPU runs the verification before, from the numbers of the one before
    that (one verification stale): choosing after the loop's sync instead kept the GPU idle for the whole decision,
    a visible part of a small model's verification (results/planner_sweeps). Those numbers stay on the
    device (`pending`) until the loop's one sync reads them (`read`)."""

    def __init__(self, gamma: int, width: int, policy: AutoGamma | None, B: int, n_new: int):
        self.gamma, self.width, self.policy = gamma, width, policy
        self.pending = None  # the last verification's numbers for the policy, on the device
        self.read = None  # ... read by the loop's sync, for the policy to take in
        self.left = [n_new - 1] * B  # tokens each sequence still needs
        if policy:
            policy.reset()
        self.upcoming = self._choose()

    def _choose(self) -> tuple[int, int]:
        if not self.policy:
            return self.gamma, self.width
        return self.policy.choose(self.left), self.policy.chosen_width

    def next(self) -> tuple[int, int]:
        """The next verification's (gamma, width): width 1 a chain, above it a token tree."""
        if self.policy:
            self.policy.used(*self.upcoming)
        return self.upcoming

    def stage(self, batch: Batch, taken, examined, width: int = 1, ranks=None) -> None:
        """Per sequence: tokens still needed (0 once done), drafted tokens kept and examined in this verification;
        then the verification's width and, for a tree, its candidates tried and kept per sibling rank."""
        if self.policy and taken is not None:
            n, W, kept_now = batch.n_new + 1, self.policy.width, taken.sum(1)  # counts: long (taken is bool)
            tried, kept = ranks if ranks is not None else (kept_now.new_zeros(W), kept_now.new_zeros(W))
            pad = lambda t: torch.cat([t, t.new_zeros(max(W - t.numel(), 0))])[:W]  # noqa: E731
            self.pending = torch.cat([n - torch.where(batch.done, n, batch.m), kept_now, examined.sum(1),
                                      kept_now.new_full((1,), width), pad(tried), pad(kept)])

    def choose_next(self) -> None:
        """With a policy: take in what the last sync read, and choose the next gamma while the GPU works."""
        if not self.policy:
            return
        if self.read is not None:
            B, W = len(self.left), self.policy.width
            self.left, kept, reached = self.read[:B], self.read[B:2 * B], self.read[2 * B:3 * B]
            width, tried, rank_kept = self.read[3 * B], self.read[3 * B + 1:3 * B + 1 + W], self.read[3 * B + 1 + W:]
            if width > 1:
                self.policy.observe_tree(tried, rank_kept)
            else:
                self.policy.observe(kept, reached)
            self.read = None
        self.upcoming = self._choose()


class Progress:
    """A bar of the tokens the slowest sequence has (a host read per iteration, so only when shown)."""

    def __init__(self, n_new: int, desc: str, show: bool):
        self.bar, self.show, self.at, self.n_new = tqdm(total=n_new, desc=desc, disable=not show, leave=False), show, 1, n_new

    def update(self, batch: Batch) -> None:
        if self.show:
            now = int((batch.m - 1).clamp(max=self.n_new).min())
            self.bar.update(now - self.at)
            self.at = now

    def close(self) -> None:
        self.bar.close()


class Decoder:
    """The target's steps, and a drafter's, run as the step mode says: eager, `cuda_graphs` (plain capture: one
    graph per verify length, two for a model draft: its 2-token re-feed, then 1-token steps) or `compile`
    (torch.compile, reduce-overhead). With a `policy` (AutoGamma) gamma is chosen per verification, up to its largest
    candidate; each verify length gets its own graph. `graph_target` False keeps the target's steps eager (an
    offloaded cache streams on a side stream). `acceptor` (acceptance.Acceptor; default: exact greedy) decides what
    each verification keeps and samples as its `sampling` says."""

    def __init__(self, model: Transformer, acceptor: Acceptor | None = None, drafter: Drafter | None = None,
                 gamma: int = 0, step_mode: str = "eager", graph_target: bool = True, policy: AutoGamma | None = None,
                 trace: bool = False):
        self.model, self.drafter = model, drafter
        self.acceptor = Acceptor() if acceptor is None else acceptor
        self.width = drafter.width if drafter is not None else 1
        # the drafter by width: a policy with a tree may verify a chain or a tree each time (AutoGamma.attach_tree);
        # the chain is a shaped copy sharing the tree drafter's state (its cache), each verification's hooks going
        # to the copy that proposed it
        self.drafters = {self.width: drafter}
        if drafter is not None and policy is not None and self.width > 1 and drafter.shape is None:
            self.drafters[1] = drafter.shaped(1)
            width = self.width
            policy.attach_tree(width, lambda g: drafter.tree_for(g * width))
        # per verification of the last generation: each sequence's accepted count (-1 once stopped), and the gamma
        self.trace = [] if trace else None
        self.trace_gammas: list[int] = []
        self.policy = policy if drafter is not None else None
        self.gamma = (policy.max_gamma if self.policy else gamma) if drafter is not None else 0  # the largest gamma
        if step_mode == "compile":
            wrap = lambda f: torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)  # noqa: E731
        elif step_mode == "cuda_graphs":
            # a graph per plan key: a refresh's verification also writes its attention scores, a tree's masks another
            # way, a head's drafter has the target's forward copy hidden states into its buffer
            wrap = lambda f: GraphedStep(f)  # noqa: E731
        else:
            wrap = lambda f: f  # noqa: E731
        self.verify_step = wrap(self._verify_step) if graph_target else self._verify_step
        # a graph per width too: the same tokens, cache and plan take the argmax, or the `width` likeliest
        self.draft_step = (GraphedStep(self._draft_step, key=lambda *a: (self.width,))
                           if step_mode == "cuda_graphs" else wrap(self._draft_step))
        # a tree's acceptance walk and the move of its path's KV: ~200 small launches per verification, as many as
        # a small model's whole step, replayed as one graph (the move must not run twice: no warm-up)
        graphed = step_mode == "cuda_graphs" and graph_target
        self.accept_tree = GraphedStep(self._accept_tree, warm_up=False) if graphed else self._accept_tree
        self.stats = Stats(self.gamma)
        self.seconds = None  # wall seconds of the last generation, from the loop's own syncs (see generate)
        self.round_seconds: list[float] = []  # seconds of each timed run (timing.timed_generations)
        self.round_rates: list[tuple] = []  # ... and its decode tokens/s, all reach and first done

    def generate(self, cache, first: torch.Tensor, n_new: int, eos_ids=(), progress: bool = False,
                 prev: torch.Tensor | None = None):
        """Generate n_new tokens per sequence; `first` [B] is the token sampled from the prefill logits and `prev`
        [B] the prompt's last token (a draft re-feeds it). Returns ids [B, n_new] and a [B] count of tokens
        produced before stopping (EOS included); positions after a sequence stopped repeat its last token.

        One clock: the loop's one host sync per verification is where time is read (wall clock), so a run's
        seconds, and its first-done seconds (when the first sequence had n_new tokens), are both spans of the same
        clock from the same start, for speculation and baseline alike."""
        if self.gamma and prev is None:
            raise ValueError("speculative generation needs the prompt's last token (prev)")
        B, dev = first.shape[0], first.device
        batch = Batch(first, prev, n_new, self.gamma, eos_ids, cache.lengths - 1)
        schedule = GammaSchedule(self.gamma, self.width, self.policy, B, n_new)
        counts, timer = Counts(B, self.gamma, dev), PhaseTimer(dev)
        bar = Progress(n_new, "decode (speculation)" if self.gamma else "decode (baseline)", progress)
        self.before_loop(batch)
        self.acceptor.begin(B, batch.hist.shape[1], dev)
        drafter = self.drafter if self.gamma else None
        for d in self.drafters.values() if drafter is not None else ():
            d.begin()
        self.stamps = []  # wall clock at each of the loop's syncs: the start, then after each verification
        if self.trace is not None:
            self.trace, self.trace_gammas = [], []
        while not self._all_done(batch, schedule):
            gamma, self.width = schedule.next()
            drafter = self.drafters[self.width] if self.gamma else None
            t0 = timer.stamp()
            drafted, q = self._propose(batch, gamma, drafter)  # draft gamma tokens (or a tree gamma deep)
            gamma = drafted.shape[1]  # a draft may propose fewer (prompt lookup: as many as it found)
            tree = drafter.tree_for(gamma) if gamma else None
            tree = None if tree is None else tree.on_device(dev)  # its tensors, made once per shape
            t1 = timer.stamp()
            plan = (drafter.verify_plan(cache, gamma) if gamma else PLAIN).with_tree(tree)
            # verify them in one pass and accept: `drafted` becomes the chain it kept from (a tree's accepted path)
            accepted, nxt, verified, drafted, path = self._verify(cache, batch, drafted, q, plan)
            gamma = drafted.shape[1]
            t2 = timer.stamp()
            if gamma:
                drafter.after_verify(verified, path)
            self.after_verify(batch, verified, accepted)
            active = batch.commit(drafted, accepted, nxt)
            cache.rollback(batch.position(1))  # drop rejected drafts' KV; the last committed token is fed next
            if gamma:
                drafter.after_commit(cache)
            taken, examined = counts.add(gamma, accepted, active, batch.cols, batch.m - 1, n_new)
            ranks = rank_counts(tree, path, accepted, active) if tree is not None else None
            if ranks is not None:
                counts.add_ranks(*ranks)
            schedule.stage(batch, taken, examined, self.width if tree is not None else 1, ranks)
            if self.trace is not None:  # on the device: no host sync until the generation ends
                self.trace.append(torch.where(active, accepted, -1))
                self.trace_gammas.append(gamma)
            timer.add("draft", t0, t1)
            timer.add("verify", t1, t2)
            timer.add("other", t2, timer.stamp())
            schedule.choose_next()
            bar.update(batch)
        bar.close()
        if self.trace is not None:
            self.trace = torch.stack(self.trace).tolist() if self.trace else []
        self.seconds = self.stamps[-1] - self.stamps[0]
        self.stats = counts.stats(self.gamma, timer, n_new, self.policy.summary() if self.policy else None,
                                  self.stamps)
        self.stats.drafter = self.drafter.summary() if self.gamma and self.drafter is not None else None
        return batch.output()

    def before_loop(self, batch: Batch) -> None:
        """A subclass's per-generation setup (the hierarchy's middle level keeps its distributions)."""

    def after_verify(self, batch: Batch, verified: torch.Tensor, accepted: torch.Tensor) -> None:
        """A subclass's look at each verification before its tokens are committed."""

    def _all_done(self, batch: Batch, schedule: GammaSchedule) -> bool:
        """The loop's one host sync per iteration, which also reads the policy's numbers of the last verification:
        reading them anywhere else would stall the host until the verify finished, and then launch the bookkeeping
        kernels onto an idle GPU (results/planner_sweeps). The clock is read right after it."""
        if schedule.pending is None:
            finished = bool(batch.done.all())
        else:
            finished, *schedule.read = torch.cat([batch.done.all()[None].long(), schedule.pending.flatten()]).tolist()
            schedule.pending = None
        self.stamps.append(time.perf_counter())
        return bool(finished)

    @property
    def sampling(self) -> Sampling:
        return self.acceptor.sampling

    @property
    def _greedy(self) -> bool:
        return self.sampling.greedy

    def _distribution(self, model, tokens, cache, plan: ForwardPlan):
        """Greedy: argmax ids (across vocabulary shards without gathering them); sampling: probabilities. A plan's
        candidate request also gets each position's likeliest ids (over the gathered vocabulary)."""
        s, wanted = self.sampling, plan.candidates
        if self._greedy and wanted is None:
            return tp.vocab_argmax(model(tokens, cache, plan.sharded()), model.shard)
        logits = model(tokens, cache, plan)
        if wanted is not None:
            wanted.out[:, :logits.shape[1]] = torch.topk(logits, wanted.k).indices
        if self._greedy:
            return logits.argmax(-1)
        return probabilities(logits, s.temperature, s.top_p, s.top_k)

    def _verify_step(self, tokens, cache, plan: ForwardPlan):
        return self._distribution(self.model, tokens, cache, plan)

    def _draft_step(self, model, tokens, cache, plan: ForwardPlan):
        """At the last position (plan.logits "last"), or at every node of a tree level the draft feeds (plan.level)."""
        if self._greedy and self.width > 1:  # a tree's candidates: the draft's likeliest ids, best first
            out = torch.topk(model(tokens, cache, plan), self.width).indices
        else:
            out = self._distribution(model, tokens, cache, plan)
        return out[:, -1] if plan.logits == "last" else out

    def _propose(self, batch: Batch, gamma: int, drafter: Drafter | None = None):
        """The drafter's tokens [B, <= gamma] and distributions q (None when greedy); none for gamma 0."""
        if not gamma:
            return batch.hist[:, :0], None
        drafter = self.drafter if drafter is None else drafter
        return drafter.propose(self.draft_step, batch.hist, batch.m, batch.position(2), gamma)

    def _verify(self, cache, batch: Batch, drafted: torch.Tensor, q, plan: ForwardPlan = PLAIN):
        """The target's pass over the last committed token and the drafted ones (a chain, or the nodes of plan.tree, a
        tree.TreeOnDevice), as `plan` says:
        (accepted [B], next token [B], what the pass returned: argmax ids [B, g+1], or probabilities [B, g+1, V];
        the drafted chain kept from; a tree's accepted path of nodes, or None)."""
        tokens = torch.cat([batch.hist.gather(1, (batch.m - 1)[:, None]), drafted], 1)
        draws = self.acceptor.draws(batch, tokens, plan.tree)  # what its acceptance draws outside a graph (exact: none)
        if plan.tree is not None:
            return self._verify_tree(cache, tokens, q, plan, draws)
        verified = self.verify_step(tokens, cache, plan).clone()
        accepted, nxt, _ = self.acceptor.accept(verified, tokens, q, None, draws)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank holds the same logits, but random draws may differ (a draft on some ranks uses the RNG
            # there): rank 0 decides, everyone follows, so no rank can diverge or wait on another.
            dist.broadcast(accepted, src=0)
            dist.broadcast(nxt, src=0)
        return accepted, nxt, verified, drafted, None

    def _verify_tree(self, cache, tokens: torch.Tensor, q, plan: ForwardPlan, draws):
        """A token tree's verification: every node over the committed cache and its ancestors in one pass, the
        acceptor's path (acceptance.py), its KV moved to the slots its positions take. Returns what _verify does,
        the drafted chain being the path's tokens."""
        tree = plan.tree
        verified = self.verify_step(tokens, cache, plan).clone()
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        if ranks == 1:  # the acceptance, greedy or sampled, and the move graphed
            accepted, nxt, path = self.accept_tree(verified, tokens, q, draws, cache, tree)
        else:
            accepted, nxt, path = self.acceptor.accept(verified, tokens, q, tree, draws)
            for t in (path, accepted, nxt):
                dist.broadcast(t, src=0)
            cache.keep_path(path)
        return accepted, nxt, verified, path_tokens(tokens, path), path

    def _accept_tree(self, verified, tokens, q, draws, cache, tree):
        """A tree's acceptance, then the accepted path's KV moved: one graph under cuda_graphs. Sampled, its draws
        come from the device's generator, which a replay advances (no host round trip)."""
        accepted, nxt, path = self.acceptor.accept(verified, tokens, q, tree, draws)
        cache.keep_path(path)
        return accepted, nxt, path


def decode(decoder: Decoder, cache, first: torch.Tensor, n_new: int, eos_ids=(), progress: bool = False,
           prev: torch.Tensor | None = None):
    """Generate with `decoder` (see Decoder.generate); the baseline when the decoder has no drafter."""
    return decoder.generate(cache, first, n_new, eos_ids, progress, prev)
