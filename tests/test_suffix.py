"""magicdec/drafters/suffix.py (SuffixDecoding): the suffix trie against brute force over the token list (the longest
matched suffix, every continuation's count and share, appended token by token, and undone back to the prompt); the
speculation tree grown from hand-counted continuations (scores, the pruning threshold, the budget from the match
length, the template's ranks, the padding); through the decoder, greedy equal to the plain autoregressive loop for a
chain, a tree and a Sequoia shape, and sampled decoding seeded and keeping the target's distribution; bad input one
line. The registry-wide tests (tests/test_runs.py) also run it from the command line with its example options."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import chi_square
from magicdec.decoding.acceptance import Acceptor
from magicdec.decoding.generate import Decoder, decode
from magicdec.decoding.sampling import Sampling, probabilities
from magicdec.drafters import suffix
from magicdec.drafters.suffix import SuffixDraft, SuffixIndex, budget_for, filled, grow
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import LAST_LOGITS
from magicdec.model.kv_cache import KVCache
from magicdec.model.tree import Tree, shaped_tree
from test_generate_speculative import plain_greedy
from test_lookup import (POINT_MASS_COPIES, keep_every_drafted, point_mass_prompt, repetitive_prompts,
                         sampled_second_tokens, second_token_distribution)

pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


# --- the trie against brute force

def occurrences(seq: list[int], s: list[int]) -> list[int]:
    return [i for i in range(len(seq) - len(s) + 1) if seq[i:i + len(s)] == s]


def brute_match(seq: list[int], max_length: int) -> int:
    """The longest suffix of at most max_length tokens that also occurs starting earlier (0: none)."""
    n = len(seq)
    for k in range(min(max_length, n - 1), 0, -1):
        if any(i < n - k for i in occurrences(seq, seq[n - k:])):
            return k
    return 0


def brute_continuations(seq: list[int], s: list[int], window: int) -> list[tuple[int, float]]:
    """After the string s: each next token with its count over the occurrences followed by one (within the window),
    most frequent first, equal counts the latest occurrence first."""
    if len(s) >= window:
        return []
    found = {}
    for i in occurrences(seq, s):
        if i + len(s) < len(seq):
            found.setdefault(seq[i + len(s)], []).append(i)
    total = sum(len(v) for v in found.values())
    ranked = sorted(found, key=lambda t: (-len(found[t]), -max(found[t])))
    return [(t, len(found[t]) / total) for t in ranked]


def check_below(index: SuffixIndex, seq: list[int], s: list[int], place) -> None:
    """Every string below s in the trie (to the window's depth): its continuations equal brute force's."""
    got = index.continuations(place, 10 ** 6)
    assert [(t, pytest.approx(share)) for t, share, _ in got] == brute_continuations(seq, s, index.window), s
    for token, _, below in got:
        check_below(index, seq, s + [token], below)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_trie_equals_brute_force_token_by_token(seed):
    rng = random.Random(seed)
    window, max_length = 6, 4
    seq = [rng.randrange(3) for _ in range(12)]
    index = SuffixIndex(window, seq)
    for _ in range(60):
        token = rng.randrange(3 if rng.random() < 0.8 else 5)
        seq.append(token)
        index.append(token)
        assert index.tokens == seq
        matched, place = index.match(max_length)
        assert matched == brute_match(seq, max_length)
        if matched:
            check_below(index, seq, seq[len(seq) - matched:], place)
        assert len(index.open) < window  # the windows a token moves: at most the window's depth
    root = [(t, c) for t, c in sorted(index.children[0].items())]
    assert {t for t, _ in root} == set(seq)


def test_text_that_never_repeats_is_one_tail_per_position():
    """Distinct tokens: no branch is shared, so the trie holds the root alone (each position a tail) and nothing
    matches; a repeat then makes the shared branch a node."""
    index = SuffixIndex(64, range(1000))
    assert len(index.count) == 1 and len(index.children[0]) == 1000 and index.match(64) == (0, None)
    index.append(500)
    assert index.match(64)[0] == 1 and len(index.count) == 2
    assert [(t, s) for t, s, _ in index.continuations(index.match(64)[1], 5)] == [(501, 1.0)]


def test_a_generation_is_undone_back_to_the_prompt():
    """mark() after the prompt, tokens appended, reset(): the trie is the prompt's again, field by field, and the
    same tokens appended again give the same trie as the first time."""
    rng = random.Random(5)
    prompt = [rng.randrange(4) for _ in range(80)]
    fresh = SuffixIndex(7, prompt)
    index = SuffixIndex(7, prompt)
    index.mark()
    fields = lambda ix: (ix.tokens, ix.children, ix.count, ix.followed, ix.latest, ix.depth, ix.open)  # noqa: E731
    added = [rng.randrange(4) for _ in range(50)]
    for t in added:
        index.append(t)
    after = copy.deepcopy(fields(index))
    index.reset()
    assert fields(index) == fields(fresh)
    for t in added:
        index.append(t)
    assert fields(index) == after


# --- the speculation tree from hand-counted continuations

# [7, 8] occurs four times before the end: followed by 1 (three times: 1 5 20, 1 5 21, 1 6 22) and by 2 (2 3 23).
# The separators 20..23 occur once, so [7, 8] is the longest suffix that occurred before: p = 2.
KNOWN = [7, 8, 1, 5, 20, 7, 8, 1, 5, 21, 7, 8, 1, 6, 22, 7, 8, 2, 3, 23, 7, 8]


def known():
    index = SuffixIndex(8, KNOWN)
    matched, place = index.match(8)
    assert matched == 2
    return index, place


def test_shares_are_counts_over_the_occurrences_that_continued():
    index, place = known()
    first = index.continuations(place, 5)
    assert [(t, s) for t, s, _ in first] == [(1, 0.75), (2, 0.25)]  # 3 of 4, 1 of 4 (the end's own [7, 8] left out)
    after_1 = index.continuations(first[0][2], 5)
    assert [(t, s) for t, s, _ in after_1] == [(5, pytest.approx(2 / 3)), (6, pytest.approx(1 / 3))]
    after_15 = index.continuations(after_1[0][2], 5)
    assert [(t, s) for t, s, _ in after_15] == [(21, 0.5), (20, 0.5)]  # equal counts: the latest first


def scores(taken):
    return {node: (token, round(score, 6)) for node, (token, score) in taken.items()}


def test_the_tree_is_grown_by_score_into_the_templates_ranks():
    """Template: a chain of 3 with a sibling per depth (nodes 1, 2 under the root, 3, 4 under 1, 5, 6 under 3).
    Scores: 1 -> 0.75, 2 -> 0.25, 1 5 -> 0.75 x 2/3 = 0.5, 1 6 -> 0.25, 1 5 21 and 1 5 20 -> 0.25; taken best first,
    equal scores in node order."""
    index, place = known()
    template = Tree.chain_with_siblings(3, 2)
    assert template.parents == (-1, 0, 0, 1, 1, 3, 3)
    everything = grow(index, place, template, budget=6, min_score=0.1)
    assert scores(everything) == {1: (1, 0.75), 2: (2, 0.25), 3: (5, 0.5), 4: (6, 0.25), 5: (21, 0.25),
                                  6: (20, 0.25)}
    assert scores(grow(index, place, template, 3, 0.1)) == {1: (1, 0.75), 3: (5, 0.5), 2: (2, 0.25)}
    assert scores(grow(index, place, template, 6, 0.3)) == {1: (1, 0.75), 3: (5, 0.5)}  # the 0.25s pruned
    assert scores(grow(index, place, Tree.chain(3), 3, 0.1)) == {1: (1, 0.75), 2: (5, 0.5), 3: (21, 0.25)}
    assert grow(index, place, template, 6, 0.8) == {}


def test_the_budget_is_the_match_length_times_the_factor_at_most_the_template():
    template = Tree.chain_with_siblings(3, 2)  # 6 drafted nodes
    assert [budget_for(template, 2, f) for f in (0.4, 1.0, 1.2, 2.0, 4.0)] == [1, 2, 3, 4, 6]
    assert budget_for(Tree.chain(4), 1, 1.0) == 1 and budget_for(Tree.chain(4), 9, 1.0) == 4
    index, place = known()
    assert scores(grow(index, place, template, budget_for(template, 2, 1.0), 0.1)) == {1: (1, 0.75), 3: (5, 0.5)}


def test_unfilled_nodes_repeat_their_parents_token():
    template = Tree.chain_with_siblings(3, 2)
    taken = {1: (1, 0.75), 3: (5, 0.5)}
    assert filled(template, taken, 8, 7) == [8, 1, 8, 5, 1, 5, 5]
    assert filled(template, taken, 8, 5) == [8, 1, 8, 5, 1]


def test_a_batch_is_cut_to_its_deepest_proposal():
    """Two sequences: the first matches [7, 8] (a 2-token budget: 1 then 5, depth 2), the second never repeats
    (nothing). Width 2: two branches in level order (nodes 1, 2 under the root, 3 under 1, 4 under 2), cut to depth
    2; the second branch and the second row are padding; a batch with no match proposes nothing."""
    other = list(range(30, 30 + len(KNOWN)))
    draft = SuffixDraft(torch.tensor([KNOWN, other]), 8, 1.0, 0.1, spec_depth=3).shaped(2)
    hist = torch.tensor([[8, 0], [other[-1], 0]])
    tokens, q = draft.propose(None, hist, torch.tensor([1, 1]), None, 3)
    assert q is None and tokens.tolist() == [[1, 8, 5, 8], [other[-1]] * 4]
    assert draft.tree_for(4).parents == (-1, 0, 0, 1, 2) == Tree.branches(2, 2).in_level_order().parents
    assert draft.template(3).parents == (-1, 0, 0, 1, 2, 3, 4)
    # factor 2, a budget of 4: 1 (0.75), 5 (0.5), then 2 and its 3 (0.25 each, taken before 1 5 21's 0.25: equal
    # scores in node order), so the second branch holds 2 3
    factor_2 = SuffixDraft(torch.tensor([KNOWN]), 8, 2.0, 0.1, spec_depth=3).shaped(2)
    assert factor_2.propose(None, hist[:1], torch.tensor([1]), None, 3)[0].tolist() == [[1, 2, 5, 3]]
    assert draft.summary() == {"lookups": 2, "matches": 1, "mean_match_length": 2.0, "mean_proposed_nodes": 1.0}
    nothing = SuffixDraft(torch.tensor([other]), 8, 1.0, 0.1, spec_depth=3)
    assert nothing.propose(None, hist[1:], torch.tensor([1]), None, 3)[0].shape == (1, 0)


# --- through the decoder

def speculate(model, prompts, n_new, gamma, draft, sampling=None, trace=False):
    a, B, P = model.args, prompts.shape[0], prompts.shape[1]
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + 64 + 2, a.head_dim, torch.float32, "cpu")
    logits = model(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(P)
    decoder = Decoder(model, Acceptor(sampling) if sampling else None, drafter=draft, gamma=gamma, trace=trace)
    first = logits.argmax(-1) if sampling is None else torch.multinomial(
        probabilities(logits, sampling.temperature, sampling.top_p), 1)[:, 0]
    out, _ = decode(decoder, cache, first, n_new, prev=prompts[:, -1])
    return out, decoder


@pytest.mark.parametrize("width,shape", [(1, None), (3, None), (None, "sequoia")])
def test_greedy_speculation_equals_the_plain_loop(tiny, width, shape):
    """One prepared drafter, generated with twice (each generation starts from its prompt): a chain, a width-3
    tree, a Sequoia shape; the same ids as the plain autoregressive loop, drafted tokens kept."""
    prompts, n_new, gamma = repetitive_prompts(), 40, 4
    prepared = SuffixDraft(prompts, 16, 2.0, 0.1, spec_depth=gamma)
    tree = shaped_tree((0.7, 0.4, 0.3), 12, gamma) if shape else None
    draft = prepared.shaped(width or 1, tree)
    want = plain_greedy(tiny, prompts, n_new)
    for _ in range(2):
        out, decoder = speculate(tiny, prompts, n_new, gamma, draft)
        assert out.tolist() == want.tolist()
        assert 0 < decoder.stats.alpha <= 1 and decoder.stats.accepted > 5
        assert decoder.stats.drafter["matches"] > 0


def test_sampled_runs_are_seeded_and_keep_drafts(tiny):
    """Sampled at T 0.3 (the tiny model's text then repeats, so suffixes recur), a chain, a width-3 tree and a
    Sequoia shape: drafted tokens are kept (more than one token per verification), the same seed gives the same
    tokens, another seed other tokens."""
    prompts, sampling = repetitive_prompts(), Sampling(0.3, 0.9)
    for width, shape in ((1, None), (3, None), (1, shaped_tree((0.7, 0.4, 0.3), 12, 4))):
        runs = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            draft = SuffixDraft(prompts, 16, 1.0, 0.1, 4, vocab_size=tiny.args.vocab_size).shaped(width, shape)
            out, decoder = speculate(tiny, prompts, 40, 4, draft, sampling)
            runs.append(out)
            assert decoder.stats.omega > 1.1 and decoder.stats.accepted >= 10, (width, decoder.stats.accepted)
        assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
        assert ((runs[0] >= 0) & (runs[0] < tiny.args.vocab_size)).all()


@pytest.mark.parametrize("width", [1, 2])
def test_sampled_suffix_keeps_the_targets_distribution(tiny, monkeypatch, width):
    """N copies of a prompt whose last token occurred before: the first drafted token is its most frequent
    continuation, a point mass (width 2: beside it the next most frequent, or its parent's token repeated as
    padding); the token sampled at that position still follows the target's own distribution (chi-square below its
    1 - 3e-7 quantile); for the chain, a verifier that never rejects fails it."""
    from magicdec.decoding import acceptance

    prompt, vocab = point_mass_prompt(), tiny.args.vocab_size

    def second_tokens():
        tokens, draft = sampled_second_tokens(
            tiny, prompt, lambda copies: SuffixDraft(copies, 16, 1.0, 0.0, 1, vocab).shaped(width))
        assert draft.summary()["matches"] == POINT_MASS_COPIES
        return tokens

    p = second_token_distribution(tiny, prompt)
    stat, bound = chi_square(second_tokens(), p)
    assert stat < bound, (stat, bound)
    if width == 1:
        monkeypatch.setattr(acceptance, "speculative_sampling_verify", keep_every_drafted)
        stat, bound = chi_square(second_tokens(), p)
        assert stat > 2 * bound, (stat, bound)


# --- options

@pytest.mark.parametrize("key,value,said", [
    ("suffix_max_depth", 0, "--suffix_max_depth 0: must be at least 1"),
    ("suffix_factor", 0.0, "--suffix_factor 0.0: must be a finite number above 0"),
    ("suffix_factor", float("inf"), "--suffix_factor inf: must be a finite number above 0"),
    ("suffix_min_score", 1.5, "--suffix_min_score 1.5: must be in [0, 1]"),
    ("suffix_min_score", -0.1, "--suffix_min_score -0.1: must be in [0, 1]"),
])
def test_bad_input_is_one_line(key, value, said):
    from magicdec.harness.run_config import RunConfig

    with pytest.raises(MagicDecError) as e:
        RunConfig.from_options({"drafter": "suffix", key: value}).check()
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_its_name_alias_and_label():
    from magicdec import drafters
    from magicdec.harness.run_config import RunConfig

    assert drafters.canonical("suffix_decoding") == "suffix" and suffix.DRAFTER.supports_trees
    cfg = RunConfig.from_options({"drafter": "suffix", "suffix_factor": 2.0, "tree_width": 2})
    cfg.check()
    assert cfg.describe() == "suffix d64 f2 s0.1 tree w2"
