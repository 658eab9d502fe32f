"""The speculative loop of generate.py: greedy speculation (self-speculation with a StreamingLLM cache, and a
standalone draft) produces exactly the target's plain autoregressive output, token for token, with B=3 sequences
accepting different amounts, gamma in {1, 3, 6}, and generation running well past the draft's budget.

The reference is a hand-written loop over the model: one token per forward, argmax, no Decoder involved."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import STORIES
from magicdec.drafters.model_draft import ModelDraft
from magicdec.decoding.acceptance import Acceptor, SyntheticAcceptor
from magicdec.model.forward_plan import LAST_LOGITS
from magicdec.decoding.generate import Decoder, decode, prefill
from magicdec.decoding.sampling import Sampling
from magicdec.model.kv_cache import KVCache, StreamingCache
from magicdec.model.transformer import Transformer, load_model

GAMMAS = [1, 3, 6]


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


_greedy_runs: list = []  # (model, its weights' fingerprint, prompts, ids): plain_greedy's runs so far


def plain_greedy(model: Transformer, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """The model's greedy continuation of each prompt, n_new tokens, one forward per token. Many tests check against
    the same model's run on the same prompts: a run of at least n_new tokens made before (by this loop, the model's
    weights unchanged since) gives its first n_new tokens instead of decoding again."""
    fingerprint = [float(p.sum()) for p in model.parameters()]
    for m, f, x, ids in _greedy_runs:
        if m is model and f == fingerprint and x.shape == prompts.shape and torch.equal(x, prompts) \
                and ids.shape[1] >= n_new:
            return ids[:, :n_new].clone()
    ids = _plain_greedy(model, prompts, n_new)
    _greedy_runs.append((model, fingerprint, prompts.clone(), ids.clone()))
    return ids


def _plain_greedy(model: Transformer, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    a, (B, P) = model.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new, a.head_dim, torch.float32, "cpu")
    logits = model(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(P)
    out = []
    for _ in range(n_new):
        tok = logits.argmax(-1)
        out.append(tok)
        logits = model(tok[:, None], cache)[:, -1]
        cache.advance(1)
    return torch.stack(out, 1)


def first_layers(model: Transformer, n: int) -> Transformer:
    """A standalone draft sharing the target's vocabulary: its first n layers, final norm and head."""
    draft = Transformer(replace(model.args, n_layers=n))
    draft.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("layers.") or int(k.split(".")[1]) < n})
    return draft.eval()


def speculate(target, draft_model, prompts, n_new, gamma, budget, sinks=4, eos=(), backend="sdpa", synthetic=None,
              width=1, shape=None, reindex=False, sampling=None, **synthetic_modes):
    """Greedy speculative generation (`width` > 1: the draft's token trees; `shape`: a tree.Tree it drafts level by
    level; `synthetic`: acceptance at that rate, shaped by `synthetic_modes`, SyntheticAcceptor's); returns (ids,
    counts, decoder)."""
    a, d, (B, P) = target.args, draft_model.args, prompts.shape
    nodes = gamma * width if shape is None else shape.size - 1
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + nodes + 2, a.head_dim, torch.float32, "cpu", backend)
    if budget:
        draft_cache = StreamingCache(d.n_layers, B, d.n_kv_heads, budget, sinks, 64 + nodes, d.head_dim, torch.float32,
                                     "cpu", backend, draft_model.inv_freq if reindex else None)
    else:
        draft_cache = KVCache(d.n_layers, B, d.n_kv_heads, P + n_new + nodes + 2, d.head_dim, torch.float32, "cpu",
                              backend)
    logits = prefill(target, cache, prompts, 64)
    prefill(draft_model, draft_cache, prompts, 64)
    drafter = ModelDraft(draft_model, draft_cache).shaped(width, shape)
    acceptor = Acceptor(sampling) if synthetic is None else SyntheticAcceptor(sampling, synthetic, **synthetic_modes)
    decoder = Decoder(target, acceptor, drafter=drafter, gamma=gamma, trace=True)
    out, counts = decode(decoder, cache, logits.argmax(-1), n_new, eos, prev=prompts[:, -1])
    return out, counts, decoder


def assert_ragged(decoder):
    """Some verification kept different numbers of tokens for different sequences of the batch."""
    assert any(len({a for a in row if a >= 0}) > 1 for row in decoder.trace), decoder.trace


def check(target, draft, prompts, n_new, gamma, budget, width=1, expected=None, shape=None, backend="sdpa",
          reindex=False):
    expected = plain_greedy(target, prompts, n_new) if expected is None else expected
    out, counts, decoder = speculate(target, draft, prompts, n_new, gamma, budget, width=width, shape=shape,
                                     backend=backend, reindex=reindex)
    assert counts.tolist() == [n_new] * prompts.shape[0]
    assert out.tolist() == expected.tolist()
    assert_ragged(decoder)
    return decoder


# --- a tiny random model -------------------------------------------------------------------------------------------
def tiny_prompts(n=3, P=48):
    return torch.randint(0, 256, (n, P), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("gamma", GAMMAS)
def test_tiny_selfspec_equals_plain_greedy(tiny, gamma):
    check(tiny, tiny, tiny_prompts(), n_new=70, gamma=gamma, budget=20)  # 48 + 70 tokens, window of 16


@pytest.mark.parametrize("gamma", GAMMAS)
def test_tiny_standalone_equals_plain_greedy(tiny, gamma):
    draft = first_layers(tiny, 2)
    check(tiny, draft, tiny_prompts(), n_new=50, gamma=gamma, budget=20)
    check(tiny, draft, tiny_prompts(), n_new=30, gamma=gamma, budget=0)  # budget 0: the draft's full cache


def shaped():
    """Sequoia's tree for a draft that often agrees: a wide first level, a main branch 5 deep (in level order)."""
    from magicdec.model.tree import optimal_tree

    return optimal_tree((0.7, 0.4, 0.3), 20, 5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_tiny_drafted_tree_equals_plain_greedy(tiny, backend):
    """A tree drafted level by level (each level's nodes one forward over the draft's cache and their ancestors):
    through a StreamingLLM ring past its budget, with --reindex, and a standalone draft's full cache. Flex runs
    eagerly on a CPU (a block mask per forward): 30 tokens there, the ring already past its budget from the prompt."""
    n_new = 60 if backend == "sdpa" else 30
    expected = plain_greedy(tiny, tiny_prompts(), n_new)
    tree = shaped()
    assert tree.depth == 5 and tree.max_children >= 3
    check(tiny, tiny, tiny_prompts(), n_new=n_new, gamma=5, budget=20, shape=tree, expected=expected, backend=backend)
    if backend == "sdpa":
        check(tiny, tiny, tiny_prompts(), n_new=60, gamma=5, budget=20, shape=tree, expected=expected, reindex=True)
        draft = first_layers(tiny, 2)
        check(tiny, draft, tiny_prompts(), n_new=40, gamma=5, budget=0, shape=tree)


def test_drafted_tree_matches_the_draft_fed_each_path(tiny):
    """Each drafted node is the draft's likeliest children at its parent, as a draft fed that node's path one
    token at a time (no tree) says: the level-by-level forwards see exactly their ancestors."""
    from magicdec.model.tree import optimal_tree

    tree = optimal_tree((0.7, 0.4, 0.3), 12, 3)
    a, prompts = tiny.args, tiny_prompts(2, 30)
    cache = StreamingCache(a.n_layers, 2, a.n_kv_heads, 16, 4, 64, a.head_dim, torch.float32, "cpu")
    prefill(tiny, cache, prompts, 64)
    drafter = ModelDraft(tiny, cache).shaped(1, tree)
    decoder = Decoder(tiny, drafter=drafter, gamma=3)
    hist = torch.cat([prompts[:, -1:], torch.tensor([[5], [9]])], 1)
    m, start = torch.tensor([2, 2]), torch.full((2,), 29)
    tokens, q = drafter.propose(decoder.draft_step, hist, m, start, 3)
    assert q is None and tokens.shape == (2, tree.size - 1)
    nodes = torch.cat([hist[:, 1:], tokens], 1)  # node 0: the root
    for i in range(1, tree.size):
        path = [i]
        while path[-1]:
            path.append(tree.parents[path[-1]])
        path = path[::-1][:-1]  # root .. parent
        ref = StreamingCache(a.n_layers, 2, a.n_kv_heads, 16, 4, 64, a.head_dim, torch.float32, "cpu")
        prefill(tiny, ref, prompts, 64)
        feed = torch.cat([prompts[:, -1:], nodes[:, path]], 1)
        ref.rollback(torch.full((2,), 29))
        logits = tiny(feed, ref)[:, -1]
        rank = tree.children[tree.parents[i]].index(i)
        assert torch.equal(nodes[:, i], logits.topk(rank + 1).indices[:, rank]), i


def test_budget_covering_everything_accepts_all(tiny):
    """A self-draft whose StreamingLLM budget holds the whole context is the target itself: alpha = 1."""
    out, _, decoder = speculate(tiny, tiny, tiny_prompts(), 40, 3, budget=48 + 40 + 10)
    assert decoder.stats.alpha == 1.0
    assert decoder.stats.omega == 4.0 or decoder.stats.omega > 3.5  # the last, cut-short iteration may keep fewer
    assert out.tolist() == plain_greedy(tiny, tiny_prompts(), 40).tolist()


def test_eos_stops_each_sequence(tiny):
    expected = plain_greedy(tiny, tiny_prompts(), 40)
    eos = int(expected[1, 17])  # appears in row 1 at step 17 (maybe earlier in other rows)
    out, counts, _ = speculate(tiny, tiny, tiny_prompts(), 40, 3, budget=20, eos=[eos])
    for b in range(3):
        row = expected[b].tolist()
        stop = row.index(eos) + 1 if eos in row else 40
        assert counts[b] == stop
        assert out[b, :stop].tolist() == row[:stop]
        assert (out[b, stop:] == eos).all()


def landscape_walk(uniforms, alpha: float, n_new: int, gamma: int) -> list[list[int]]:
    """Accepted counts per verification, by hand: a sequence at committed length m drafts positions m..m+gamma-1,
    keeps the leading ones whose uniform is below alpha, then adds the target's token: m grows by kept + 1."""
    rows = []
    for u in uniforms.tolist():
        m, kept = 2, []
        while m - 1 < n_new:
            k = 0
            while k < gamma and u[m + k] < alpha:
                k += 1
            kept.append(k)
            m += k + 1
        rows.append(kept)
    return rows


def test_synthetic_acceptance_reads_one_landscape_for_every_gamma(tiny):
    """Random-weight speed runs accept a drafted token iff the landscape's number at its position is below alpha:
    every gamma meets the same hard positions (common random numbers), and the loop reads the landscape exactly
    where its tokens are (checked against a hand-written walk), whatever the target would have said."""
    alpha, n_new, landscapes = 0.7, 60, []
    for gamma in (1, 2, 4):
        _, counts, decoder = speculate(tiny, tiny, tiny_prompts(), n_new, gamma, budget=20, synthetic=alpha)
        assert counts.tolist() == [n_new] * 3
        walk = landscape_walk(decoder.acceptor.landscape, alpha, n_new, gamma)
        traced = [[row[b] for row in decoder.trace if row[b] >= 0] for b in range(3)]
        assert traced == walk
        landscapes.append(decoder.acceptor.landscape[:, :n_new])
    assert all(torch.equal(landscapes[0], other) for other in landscapes[1:])
    assert 0.55 < (landscapes[0] < alpha).double().mean() < 0.85  # ~180 uniform draws


def test_synthetic_acceptance_under_sampling_keeps_what_the_landscape_says(tiny):
    """A sampled random-weight speed run does a sampled run's work (the draft samples and returns q, the target's
    probabilities are computed and the next token drawn) and keeps what the landscape says: verification by
    verification, the same counts as the greedy synthetic run on the same landscape, with other (sampled) tokens."""
    torch.manual_seed(0)
    greedy_out, _, greedy = speculate(tiny, tiny, tiny_prompts(), 40, 3, budget=20, synthetic=0.6)
    sampled_out, counts, sampled = speculate(tiny, tiny, tiny_prompts(), 40, 3, budget=20, synthetic=0.6,
                                             sampling=Sampling(temperature=1.0))
    assert counts.tolist() == [40] * 3
    assert sampled.trace == greedy.trace
    assert any(0 < k < 3 for row in sampled.trace for k in row)
    assert not torch.equal(greedy_out, sampled_out)


def test_per_position_rates_read_the_landscape_at_each_positions_own_rate(tiny):
    """--synthetic_positions: the drafted token at position i of a verification is kept iff the landscape's number
    there is below rate i (the last rate past the list): the loop's kept counts equal a hand-written walk."""
    rates, n_new, gamma = (0.9, 0.5), 60, 3
    _, counts, decoder = speculate(tiny, tiny, tiny_prompts(), n_new, gamma, budget=20, synthetic=0.3,
                                   positions=rates)
    assert counts.tolist() == [n_new] * 3
    walk = []
    for u in decoder.acceptor.landscape.tolist():
        m, kept = 2, []
        while m - 1 < n_new:
            k = 0
            while k < gamma and u[m + k] < (rates[k] if k < len(rates) else 0.3):
                k += 1
            kept.append(k)
            m += k + 1
        walk.append(kept)
    assert [[row[b] for row in decoder.trace if row[b] >= 0] for b in range(3)] == walk
    assert any(k == 1 for row in walk for k in row) and any(k == 3 for row in walk for k in row)


@pytest.mark.parametrize("gamma", [3, 5])
def test_acceptance_trace_replays_a_recorded_run(tiny, gamma):
    """A recorded run's trace (each sequence's kept count per verification; here a synthetic run at 0.7 on its own
    landscape, which keeps runs of several tokens), replayed as synthetic acceptance at another rate: at
    the recorded gamma every sequence keeps exactly what it kept, verification by verification, and a batch larger
    than the trace's repeats its sequences in turn; at another gamma each sequence still keeps the positions it kept
    and rejects the ones it rejected (what the recorded run left open is drawn at that sequence's own rate)."""
    _, _, real = speculate(tiny, tiny, tiny_prompts(), 60, 3, budget=20, synthetic=0.7)
    recorded = [[row[b] for row in real.trace if row[b] >= 0] for b in range(3)]
    assert len({tuple(r) for r in recorded}) == 3  # the sequences differ
    replay = {"gammas": real.trace_gammas, "accepted": [list(s) for s in zip(*real.trace)]}
    prompts = tiny_prompts(5)
    _, counts, synthetic = speculate(tiny, tiny, prompts, 60, gamma, budget=20, synthetic=0.5, replay=replay)
    assert counts.tolist() == [60] * 5
    kept = [[row[b] for row in synthetic.trace if row[b] >= 0] for b in range(5)]
    if gamma == 3:
        assert kept == recorded + recorded[:2]
    else:  # per position: what the recorded run kept is kept whenever drafted, what it rejected never is
        for b in range(5):
            col, was_kept, was_rejected = 2, set(), set()
            for a in recorded[b % 3]:
                was_kept |= set(range(col, col + a))
                if a < 3:  # kept all 3: the next token was the target's, no draft rejected
                    was_rejected.add(col + a)
                col += a + 1
            col = 2
            for a in kept[b]:
                assert not set(range(col, col + a)) & was_rejected
                if a < gamma:
                    assert col + a not in was_kept
                col += a + 1
        assert kept != recorded + recorded[:2]


def test_flex_backend_speculates_identically(tiny):
    expected = plain_greedy(tiny, tiny_prompts(), 30)
    out, _, _ = speculate(tiny, tiny, tiny_prompts(), 30, 3, budget=20, backend="flex")
    assert out.tolist() == expected.tolist()


def check_drafter(target, drafter, prompts, n_new, gamma, nodes, expected):
    """Greedy speculation with a drafter that needs no draft model (prompt lookup, Lookahead) equals plain greedy
    decoding; `nodes`: the most tokens a verification writes into the cache."""
    a, (B, P) = target.args, prompts.shape
    cache = KVCache(a.n_layers, B, a.n_kv_heads, P + n_new + nodes + 2, a.head_dim, torch.float32, "cpu")
    logits = prefill(target, cache, prompts, 64)
    decoder = Decoder(target, drafter=drafter, gamma=gamma, trace=True)
    out, counts = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert counts.tolist() == [n_new] * B
    assert out.tolist() == expected.tolist()
    assert max(max(row) for row in decoder.trace) >= 1  # some drafted tokens kept
    return decoder


def check_every_tree_drafter(model, prompts, n_new, budget):
    """The self-draft's tree (3 candidates per position, past its StreamingLLM budget), prompt lookup's branches and
    Lookahead's window with its guesses: each equal to plain greedy decoding."""
    from magicdec.drafters.lookahead import LookaheadDraft
    from magicdec.drafters.lookup import PromptLookup

    expected = plain_greedy(model, prompts, n_new)
    check(model, model, prompts, n_new=n_new, gamma=3, budget=budget, width=3, expected=expected)
    lookup = PromptLookup(prompts, ngram_max=3).shaped(3)
    check_drafter(model, lookup, prompts, n_new, gamma=4, nodes=3 * 4, expected=expected)
    lookahead = LookaheadDraft(prompts, window=4, n=4, guesses=3, pool=64, seed=0)
    check_drafter(model, lookahead, prompts, n_new, gamma=5, nodes=lookahead.tree.size, expected=expected)


# --- SmolLM2-135M (real weights) ----------------------------------------------------------------------------------
def test_smollm2_selfspec_equals_plain_greedy(smol_model, smol_prompts):
    """Real weights at one gamma: gammas 1, 3 and 6 run the same code, each checked on the tiny model and
    stories260K above and below."""
    check(smol_model, smol_model, smol_prompts, n_new=48, gamma=3, budget=32)


def test_smollm2_standalone_equals_plain_greedy(smol_model, smol_prompts):
    check(smol_model, first_layers(smol_model, 10), smol_prompts, n_new=40, gamma=3, budget=32)


def test_smollm2_tree_drafters_equal_plain_greedy(smol_model, smol_prompts):
    check_every_tree_drafter(smol_model, smol_prompts, n_new=32, budget=24)


# --- stories260K (real weights, llama2.c) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    from magicdec.model.checkpoint import convert_llama2c


    path = convert_llama2c(STORIES / "stories260K.bin", tmp_path_factory.mktemp("stories"))
    return load_model(path, "cpu", torch.float32)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_stories260k_selfspec_and_standalone_equal_plain_greedy(stories, gamma):
    prompts = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(gamma))
    prompts[:, 0] = 1
    check(stories, stories, prompts, n_new=100, gamma=gamma, budget=24)
    check(stories, first_layers(stories, 2), prompts, n_new=60, gamma=gamma, budget=24)


def test_stories260k_tree_drafters_equal_plain_greedy(stories):
    prompts = torch.randint(3, 512, (3, 40), generator=torch.Generator().manual_seed(7))
    prompts[:, 0] = 1
    check_every_tree_drafter(stories, prompts, n_new=80, budget=24)
