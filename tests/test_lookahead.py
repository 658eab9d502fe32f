"""Lookahead decoding (magicdec/drafters/lookahead.py): its tree against LADE's attention mask written out by hand,
its n-gram pool against a list kept the way LADE keeps its own, the Jacobi window's step, greedy speculation equal
to plain greedy decoding, and its bad input."""
from __future__ import annotations

import pytest
import torch

from magicdec.drafters.lookahead import LookaheadDraft, lookahead_tree
from magicdec.model.forward_plan import LAST_LOGITS


def lade_visible(window: int, n: int, guesses: int):
    """LADE's mask (lade/models/modeling_llama.py, j_make_causal_mask_multilevel), written out per node: the root;
    guess g's token j sees the root and its branch's tokens up to j; the window's token at level l, column i sees
    level 0's columns 0..i (column 0 is the root) and, for l >= 1, levels 1..l of its own column. Also each node's
    position past the root. Nodes named ("guess", g, j) and ("win", l, i)."""
    names, seen, pos = [("root",)], {("root",): {("root",)}}, {("root",): 0}
    for g in range(guesses):
        for j in range(n - 1):
            names.append(("guess", g, j))
            seen[names[-1]] = {("root",)} | {("guess", g, k) for k in range(j + 1)}
            pos[names[-1]] = j + 1
    level0 = lambda i: ("root",) if i == 0 else ("win", 0, i)  # noqa: E731
    for i in range(1, window):
        names.append(("win", 0, i))
    for level in range(1, n - 1):
        for i in range(window):
            names.append(("win", level, i))
    for name in names:
        if name[0] == "win":
            _, level, i = name
            seen[name] = {level0(c) for c in range(i + 1)} | {("win", k, i) for k in range(1, level + 1)}
            pos[name] = i + level
    return names, seen, pos


@pytest.mark.parametrize("window,n,guesses", [(4, 4, 2), (2, 3, 1), (5, 5, 3)])
def test_tree_is_lades_mask(window, n, guesses):
    names, seen, pos = lade_visible(window, n, guesses)
    tree = lookahead_tree(window, n, guesses)
    assert tree.size == len(names) == (n - 1) * (window + guesses)
    for i, name in enumerate(names):
        assert {names[j] for j in range(tree.size) if tree.ancestors[i, j]} == seen[name], name
        assert tree.depths[i] == pos[name], name


class LRU:
    """LADE's pool with a bound: n-grams in filing order, one filed again moves to the end; the oldest go first."""

    def __init__(self, size):
        self.size, self.grams = size, []

    def file(self, grams):
        for g in grams:
            if g in self.grams:
                self.grams.remove(g)
            self.grams.append(g)
            if len(self.grams) > self.size:
                self.grams.pop(0)

    def guesses(self, root, k):
        return [g[1:] for g in reversed(self.grams) if g[0] == root][:k]


def test_pool_keeps_the_latest_distinct_ngrams():
    g = torch.Generator().manual_seed(0)
    B, W, N, P, G = 3, 4, 3, 12, 3
    draft = LookaheadDraft(torch.randint(0, 5, (B, 20), generator=g), W, N, G, P, seed=0)
    refs = [LRU(P) for _ in range(B)]
    for step in range(40):
        grams = torch.randint(0, 3, (B, W, N), generator=g)  # few values: many twins, within a step too
        draft.file(grams)
        for b in range(B):
            refs[b].file([tuple(x) for x in grams[b].tolist()])
        root = torch.randint(0, 3, (B,), generator=g)
        hist, m = root[:, None], torch.ones(B, dtype=torch.long)
        tokens, q = draft.propose(None, hist, m, None, 0)
        assert q is None
        got = tokens[:, :G * (N - 1)].view(B, G, N - 1).tolist()
        for b in range(B):
            want = refs[b].guesses(int(root[b]), G)
            if not want:
                assert got[b] == [[int(root[b])] * (N - 1)] * G
            else:
                assert [tuple(x) for x in got[b][:len(want)]] == want and \
                    all(tuple(x) == want[0] for x in got[b][len(want):])
        stamps = draft.stamp[:, :P]
        assert ((stamps >= 0).sum(1) == torch.tensor([len(r.grams) for r in refs])).all()


def test_jacobi_step_files_each_column_and_moves_the_window_down():
    W, N, G = 3, 4, 1
    prompts = torch.arange(100, 110)[None]
    draft = LookaheadDraft(prompts, W, N, G, 16, seed=1)
    before = draft.window.clone()
    hist, m = torch.tensor([[7]]), torch.ones(1, dtype=torch.long)
    tokens, _ = draft.propose(None, hist, m, None, 0)
    assert tokens.shape[1] == lookahead_tree(W, N, G).size - 1
    assert tokens[0, G * (N - 1):].tolist() == before[0, 0, 1:].tolist() + before[0, 1:].flatten().tolist()
    out = torch.arange(tokens.shape[1] + 1)[None] + 50  # the target's "argmax" at every node
    draft.after_verify(out)
    top = out[0, -W:].tolist()
    cols = [[7 if (level, i) == (0, 0) else int(before[0, level, i]) for level in range(N - 1)] for i in range(W)]
    for i in range(W):
        hist = torch.tensor([[cols[i][0]]])
        tokens, _ = draft.propose(None, hist, m, None, 0)
        assert tokens[0, :N - 1].tolist() == cols[i][1:] + [top[i]]
    assert draft.window[0, :-1].tolist() == before[0, 1:].tolist() and draft.window[0, -1].tolist() == top


@pytest.mark.parametrize("window,n,guesses", [(3, 3, 2), (4, 4, 4)])
def test_lookahead_speculation_equals_plain_greedy(tiny, window, n, guesses):
    """Ragged lengths of committed tokens, a pool that fills up (the tiny model repeats itself): plain greedy's ids,
    and some verifications keep more than one token."""
    from magicdec.decoding.generate import Decoder, decode
    from magicdec.model.kv_cache import KVCache
    from test_generate_speculative import plain_greedy

    torch.manual_seed(0)
    B, P, n_new = 3, 12, 40
    prompts = torch.randint(0, 256, (B, P))
    want = plain_greedy(tiny, prompts, n_new)
    a = tiny.args
    draft = LookaheadDraft(prompts, window, n, guesses, 32, seed=0)
    gamma = window + n - 3
    nodes = draft.tree.size
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + nodes + 2, a.head_dim, torch.float32, "cpu")
    logits = tiny(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(P)
    decoder = Decoder(tiny, drafter=draft, gamma=gamma)
    decoder.trace = []
    out, count = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert (out == want).all()
    assert max(max(t) for t in decoder.trace) >= 1 and int(draft.found) > 0


@pytest.mark.parametrize("flags,needle", [
    (["--gamma", "3", "--ngram_size", "2"], "at least 3 tokens"),
    (["--gamma", "2", "--ngram_size", "5"], "give --gamma 4"),
    (["--gamma", "12", "--ngram_size", "5", "--guesses", "10"], "at most 64"),
    (["--gamma", "4", "--guesses", "0"], "1 <= guesses"),
    (["--gamma", "4", "--tree_width", "2"], "its tree is its own"),
])
def test_bad_lookahead_flags_are_one_line(flags, needle):
    from magicdec.cli import config_from_argv
    from magicdec.errors import MagicDecError

    with pytest.raises(MagicDecError, match=needle) as e:
        config_from_argv(["--drafter", "lookahead", "--random_weights", "--model_name", "JackFram/llama-68m",
                          *flags], "test").check()
    assert "\n" not in str(e.value)
