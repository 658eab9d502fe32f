"""SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
NeurIPS 2025): no draft model. Each sequence's prompt and committed tokens are indexed by a suffix trie counting how
often every string of up to W tokens occurred; the longest suffix of the sequence (at most --suffix_max_depth
tokens, p of them) that occurred before is matched, and a speculation tree is grown below it greedily by score: a
candidate child scores (its count / its parent's count) x its parent's score, the best-scoring candidates are taken
until the budget, min(the tree's drafted nodes, ceil(--suffix_factor x p)) (the paper's adaptive length, alpha x
p), and none scoring below --suffix_min_score is proposed. A chain (--tree_width 1) is the single most frequent
continuation.

The trie (SuffixIndex) is extended by each committed token: the windows still growing along shared branches take
one step each, so a token costs at most W steps, never a rebuild. A branch that one occurrence alone has reached is
kept as a pointer into the sequence (a tail) until a second occurrence splits it, so the prompt's unrepeated text
costs one entry per position, not W. W is --suffix_max_depth plus the deepest speculation (the run's largest gamma):
a match of up to max_depth tokens always has gamma tokens of continuation indexed below it.

The verification takes one static tree shape for the whole batch (one CUDA graph per shape), so the per-sequence
trees are fitted into a template, as REST's and Token Recycling's are: the chain, --tree_width K's K branches (REST's
and prompt lookup's shape: the K most frequent next tokens, each followed by its own most frequent continuation), or
--tree_nodes' Sequoia shape. Branches rather than a chain with siblings at every depth, because a trie's alternatives
sit near the match: a few tokens on, the context is one earlier occurrence (a tail), which continues one way only. A
sequence's candidates go to the template's nodes by sibling rank (the most frequent continuation to a node's first
child, the next to its second, ...) and only template nodes are grown. The template is cut to the deepest level any
sequence filled (prompt lookup's precedent: a verification as long as the longest real proposal; nothing filled: a
plain decode step), and a node left unfilled repeats its parent's token (lookup's padding), which the verification
keeps only where the target would have produced it anyway.

Proposals are deterministic candidates, so greedy and sampled verification are lossless as for prompt lookup and
REST: a chain's q is one-hot at its tokens, a tree's siblings go through the multi-candidate rule (q None). The
lookup runs on the host, per sequence, after one read of the committed tokens per verification (as REST's).

What differs from the paper, and why:
- Each generation starts from its prompt alone: the paper (and vLLM) also keeps a global tree over earlier requests'
  outputs, but timed rounds of one batch must start alike (Token Recycling's matrix starts over the same way).
- The speculation tree takes the template's shape (above) instead of a free one, bounded by 64 nodes (the attention
  kernel's mask).
- A match is at most --suffix_max_depth tokens and the speculation below it up to gamma more, where vLLM's tree depth
  bounds the match and the speculation together (a long match there leaves little to speculate).
- A node's count in a score's denominator is its occurrences that a token followed: the occurrence ending the
  sequence has no continuation yet and would lower every share. Candidates of equal count: the latest occurrence's
  first (as prompt lookup prefers the latest).
- --suffix_min_score prunes on a node's score (the estimated chance its whole path is right), as the budget is spent.

Defaults: --suffix_factor 4.0, the top of the paper's range (vLLM ships 1.0). Here gamma, or the tree's nodes, already
caps a verification; the factor only decides how much of that cap a short match may fill. On SmolLM2's real text
(results/suffix) 4.0 kept more tokens per verification than 1.0 greedy, and sampled over 64 tokens (over 256 the two
were within the rounds' spread); at 1.0 a tree stayed about the chain's size over the first 64 tokens, where matches
averaged about 3 tokens. --suffix_min_score 0.1 (vLLM's min_token_prob); --suffix_max_depth 64 (the paper's cap on
the indexed depth).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magicdec.analysis import cost_model as cm
from magicdec.decoding.generate import Drafter
from magicdec.drafters.base import DrafterKind
from magicdec.errors import MagicDecError
from magicdec.model.tree import Tree
from magicdec.options import option


ABSENT = object()  # a journaled child entry that did not exist before


class SuffixIndex:
    """One sequence's suffix trie: every string of up to `window` tokens that occurs in it, with its count.

    Nodes are explicit (ids into the lists below) where at least two occurrences share the branch; a branch one
    occurrence alone reaches is a tail, stored in its parent's children as ~start (start: where that occurrence
    begins), its tokens read from the sequence. `open` holds the windows still growing along explicit nodes (start,
    node): each appended token moves each of them one step; the others are tails, which grow by the sequence itself.

    `mark()` remembers the state and `reset()` returns to it, undoing a generation's tokens from a journal of what
    they changed instead of rebuilding from the prompt."""

    def __init__(self, window: int, tokens=()):
        self.window = window
        self.tokens: list[int] = []
        self.children: list[dict[int, int]] = [{}]
        self.count = [0]  # occurrences through the node (the root's: windows started)
        self.followed = [0]  # ... of which a token followed within the window
        self.latest = [-1]  # the latest occurrence's start (ties between equal counts)
        self.depth = [0]
        self.open: list[tuple[int, int]] = []
        self.journal: list[tuple] | None = None
        self.saved = None
        for t in tokens:
            self.append(int(t))

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.open.append((len(self.tokens) - 1, 0))  # the window starting at the new token, at the root
        growing = []
        for start, node in self.open:
            child = self._step(start, node, token)
            if child is not None and self.depth[child] < self.window:
                growing.append((start, child))
        self.open = growing

    def _step(self, start: int, node: int, token: int) -> int | None:
        """One occurrence at `node` followed by `token`: its child, or None where it became a tail."""
        self._set(node, self.followed, node, self.followed[node] + 1)
        child = self.children[node].get(token)
        if child is None:
            self._set(node, self.children[node], token, ~start)
            return None
        if child < 0:
            child = self._split(node, token, ~child)
        self._set(child, self.count, child, self.count[child] + 1)
        self._set(child, self.latest, child, start)
        return child

    def _split(self, node: int, token: int, other: int) -> int:
        """The tail of the occurrence starting at `other` becomes an explicit node (it and the one arriving share
        it), the rest of that tail below it. Its next token is always known: it began before the one arriving."""
        d = self.depth[node] + 1
        child = len(self.count)
        self.children.append({})
        self.count.append(1)
        self.followed.append(0)
        self.latest.append(other)
        self.depth.append(d)
        if d < self.window:
            self.children[child][self.tokens[other + d]] = ~other
            self.followed[child] = 1
        self._set(node, self.children[node], token, child)
        return child

    def _set(self, node: int, column, key: int, value: int) -> None:
        """column[key] = value for `node` (one of its lists' entries, or its children's): journaled where the node
        is older than mark() (newer nodes are dropped whole by reset())."""
        if self.journal is not None and node < self.saved[1]:
            self.journal.append((column, key, column.get(key, ABSENT) if isinstance(column, dict) else column[key]))
        column[key] = value

    def mark(self) -> None:
        self.saved = (len(self.tokens), len(self.count), list(self.open))
        self.journal = []

    def reset(self) -> None:
        """Back to the state at mark(): the journal undone, newer nodes and tokens dropped."""
        for column, key, before in reversed(self.journal):
            if before is ABSENT:
                del column[key]
            else:
                column[key] = before
        n_tokens, n_nodes, self.open = self.saved[0], self.saved[1], list(self.saved[2])
        del self.tokens[n_tokens:]
        for column in (self.children, self.count, self.followed, self.latest, self.depth):
            del column[n_nodes:]
        self.journal = []

    def match(self, max_length: int):
        """(p, place): the longest suffix of at most max_length tokens that occurred before (its p tokens, and where
        it is: a node); (0, None) where even the last token is new."""
        n = len(self.tokens)
        for start, node in self.open:  # oldest first: the longest suffixes
            if n - start <= max_length:
                return n - start, node
        return 0, None

    def continuations(self, place, k: int) -> list[tuple[int, float, object]]:
        """Up to k (token, share, place) after `place` (a node id, or a tail: (start, depth)), most frequent first
        (equal counts: the latest occurrence first); share: the child's count over the occurrences that continued."""
        if isinstance(place, tuple):
            start, d = place
            at = start + d
            if d >= self.window or at >= len(self.tokens):
                return []
            return [(self.tokens[at], 1.0, (start, d + 1))]
        total = self.followed[place]
        d = self.depth[place]
        ranked = heapq.nlargest(k, ((self._weight(c), t, c) for t, c in self.children[place].items()))
        return [(t, w[0] / total, (~c, d + 1) if c < 0 else c) for w, t, c in ranked]

    def _weight(self, child: int) -> tuple[int, int]:
        return (1, ~child) if child < 0 else (self.count[child], self.latest[child])


def grow(index: SuffixIndex, place, template: Tree, budget: int, min_score: float) -> dict[int, tuple[int, float]]:
    """The speculation tree below `place`, fitted into `template`: {template node: (token, score)}. Greedy by score:
    the best candidate is taken, then its own children (by sibling rank, as many as the template gives the node)
    become candidates, until `budget` nodes are taken or no candidate scores min_score."""
    taken: dict[int, tuple[int, float]] = {}
    frontier: list[tuple[float, int, int, object]] = []

    def offer(node: int, at, score: float) -> None:
        slots = template.children[node]
        for slot, (token, share, below) in zip(slots, index.continuations(at, len(slots))):
            if score * share >= min_score:
                heapq.heappush(frontier, (-score * share, slot, token, below))

    offer(0, place, 1.0)
    while frontier and len(taken) < budget:
        negative, slot, token, below = heapq.heappop(frontier)
        taken[slot] = (token, -negative)
        offer(slot, below, -negative)
    return taken


def budget_for(template: Tree, matched: int, factor: float) -> int:
    """The paper's adaptive length: ceil(factor x match length), at most the template's drafted nodes."""
    return min(template.size - 1, math.ceil(factor * matched))


def filled(template: Tree, taken: dict[int, tuple[int, float]], root: int, n: int) -> list[int]:
    """The template's first n nodes' tokens, root first: a taken node's token, an unfilled one its parent's."""
    out = [root]
    for i in range(1, n):
        out.append(taken[i][0] if i in taken else out[template.parents[i]])
    return out


@dataclass
class Tally:
    """What the summary reports, shared by the shaped copies of one drafter."""
    lookups: int = 0
    matches: int = 0
    matched_tokens: int = 0
    proposed_nodes: int = 0


class SuffixDraft(Drafter):
    """Per sequence a SuffixIndex over its prompt (built once) and its committed tokens (each generation's undone at
    begin()). `vocab_size` set: sampled decoding (a chain's q is one-hot at its tokens). `full`: synthetic
    acceptance, every verification as deep as the template (as prompt lookup's)."""

    whole_run_warm_up = True  # a verification is as deep as the batch's deepest proposal: its shape varies

    def __init__(self, prompts: torch.Tensor, max_depth: int, factor: float, min_score: float, spec_depth: int,
                 vocab_size: int | None = None, full: bool = False):
        self.max_depth, self.factor, self.min_score = max_depth, factor, min_score
        self.vocab_size, self.full = vocab_size, full
        self.indexes = [SuffixIndex(max_depth + spec_depth, row) for row in prompts.cpu().tolist()]
        for index in self.indexes:
            index.mark()
        self.seen = [1] * len(self.indexes)  # hist columns indexed per sequence (column 0: the prompt's last token)
        self.tally = Tally()

    def begin(self) -> None:
        for index in self.indexes:
            index.reset()
        self.seen[:] = [1] * len(self.indexes)
        self.tally.__init__()

    def template(self, gamma: int) -> Tree:
        """The chain, the branches or the Sequoia shape, numbered level by level: its levels down to any depth are a
        prefix of its nodes."""
        if self.shape is not None:
            return self.shape
        return Tree.chain(gamma) if self.width == 1 else Tree.branches(gamma, self.width).in_level_order()

    def tree_for(self, tokens: int):
        """The template's first tokens + 1 nodes (its levels down to the proposal's depth); None for a chain."""
        if self.shape is not None:
            return self.shape if tokens + 1 == self.shape.size else Tree(self.shape.parents[:tokens + 1])
        return None if self.width == 1 else self.template(tokens // self.width)

    def _sync(self, hist: torch.Tensor, m: torch.Tensor) -> None:
        """Each sequence's committed tokens since the last verification into its index."""
        rows, counts = hist.cpu().tolist(), m.cpu().tolist()
        for b, index in enumerate(self.indexes):
            for token in rows[b][self.seen[b]:counts[b]]:
                index.append(token)
            self.seen[b] = max(self.seen[b], counts[b])

    def _grow(self, index: SuffixIndex, template: Tree) -> dict[int, tuple[int, float]]:
        matched, place = index.match(self.max_depth)
        self.tally.lookups += 1
        if not matched:
            return {}
        taken = grow(index, place, template, budget_for(template, matched, self.factor), self.min_score)
        self.tally.matches += bool(taken)
        self.tally.matched_tokens += matched if taken else 0
        self.tally.proposed_nodes += len(taken)
        return taken

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """The template's nodes after the root down to the deepest level any sequence filled ([B, n], node order);
        none where no sequence matched."""
        self._sync(hist, m)
        template = self.template(gamma)
        taken = [self._grow(index, template) for index in self.indexes]
        depth = template.depth if self.full else max((template.depths[i] for t in taken for i in t), default=0)
        if depth == 0:
            return hist[:, :0], None
        n = template.levels[depth].stop
        rows = [filled(template, t, index.tokens[-1], n)[1:] for t, index in zip(taken, self.indexes)]
        tokens = torch.tensor(rows, dtype=torch.long, device=hist.device)
        chain = self.width == 1 and self.shape is None
        q = F.one_hot(tokens, self.vocab_size).float() if chain and self.vocab_size is not None else None
        return tokens, q

    def summary(self) -> dict:
        """Lookups (a sequence's, per verification), matches (lookups that proposed a node), the mean length of
        their matched suffixes, and the real (unpadded) nodes proposed per lookup."""
        t = self.tally
        return {"lookups": t.lookups, "matches": t.matches,
                "mean_match_length": t.matched_tokens / t.matches if t.matches else 0.0,
                "mean_proposed_nodes": t.proposed_nodes / t.lookups if t.lookups else 0.0}


@dataclass(frozen=True)
class Config:
    suffix_max_depth: int = option(64, "SuffixDecoding: the longest suffix of the sequence matched (tokens); the trie "
                                       "indexes this many plus gamma after every position")
    suffix_factor: float = option(4.0, "SuffixDecoding's adaptive length: a match of p tokens speculates at most "
                                       "ceil(factor x p) nodes (gamma, or the tree's nodes, at most)")
    suffix_min_score: float = option(0.1, "SuffixDecoding: no node is proposed whose score (the product of the "
                                          "continuation shares on its path) is below this")


# what `magicdec plan` composes: a chain, two and four branches, at the default factor (4) and at vLLM's 1, which
# drafts less on short matches (a smaller verification where a batch is compute-bound)
PLAN_WIDTHS = (1, 2, 4)
PLAN_FACTORS = (4.0, 1.0)


class Suffix(DrafterKind):
    name = "suffix"
    aliases = ("suffix_decoding",)
    description = ("SuffixDecoding: no draft model; a suffix trie of each sequence's prompt and output, the longest "
                   "matching suffix's continuations grown into a tree by frequency, as many nodes as the match is "
                   "long (x --suffix_factor)")
    Config = Config
    example = {"suffix_max_depth": 16}
    supports_auto_gamma = False
    supports_trees = True
    drafts_shaped_trees = True

    def label(self, draft) -> str:
        return f"{self.name} d{draft.suffix_max_depth} f{draft.suffix_factor:g} s{draft.suffix_min_score:g}"

    def describe(self, cfg) -> str:
        d = cfg.draft
        return (f"none: SuffixDecoding (suffixes up to {d.suffix_max_depth} tokens, {d.suffix_factor:g} x the match "
                f"nodes, scores from {d.suffix_min_score:g})")

    def check(self, cfg) -> None:
        super().check(cfg)
        check_options(cfg.draft)

    def prepare(self, cfg, ctx) -> SuffixDraft:
        d = cfg.draft
        return SuffixDraft(ctx.prompts, d.suffix_max_depth, d.suffix_factor, d.suffix_min_score,
                           cfg.speculation.largest, None if cfg.decoding.greedy else ctx.target.args.vocab_size,
                           full=cfg.speculation.synthetic_acceptance is not None)

    def options(self, cfg, target, device) -> list[dict]:
        return [{"tree_width": w} | ({"suffix_factor": f} if f != Config.suffix_factor else {})
                for f in PLAN_FACTORS for w in PLAN_WIDTHS]

    def predict(self, cfg, target, models, device, alpha, gamma, lookahead, summary=None) -> dict | None:
        """No draft steps: the host-side lookup is in the fixed cost per verification (T_O), as prompt lookup's
        search is; the verification of the chain, the branches or the Sequoia shape (a tree's later candidates at
        --synthetic_siblings; None without them). Like lookup's, it takes the whole template proposed every time,
        so it overstates Omega where short matches propose less."""
        w, s = cfg.workload, cfg.speculation
        if (s.tree_width > 1 or s.tree_nodes) and not s.synthetic_siblings:
            return None
        tree = s.drafted_tree(gamma) or (Tree.branches(gamma, s.tree_width) if s.tree_width > 1 else None)
        p = cm.predict(target, device, w.B, w.prefix_len + w.gen_len // 2, gamma, alpha, 0, None, 0,
                       not cfg.decoding.greedy, tree=tree, sibling_rates=s.synthetic_siblings)
        return cm.without_draft_steps(p, gamma)


def check_options(d: Config) -> None:
    if d.suffix_max_depth < 1:
        raise MagicDecError(f"--suffix_max_depth {d.suffix_max_depth}: must be at least 1 (the longest suffix "
                            "matched, in tokens; the paper's 64 is the default)")
    if not (d.suffix_factor > 0 and math.isfinite(d.suffix_factor)):
        raise MagicDecError(f"--suffix_factor {d.suffix_factor}: must be a finite number above 0 (a match of p "
                            "tokens speculates ceil(factor x p) nodes; 4.0 is the default)")
    if not 0 <= d.suffix_min_score <= 1:
        raise MagicDecError(f"--suffix_min_score {d.suffix_min_score}: must be in [0, 1] (a node's score is a "
                            "probability; 0 prunes nothing, the default is 0.1)")


DRAFTER = Suffix()
