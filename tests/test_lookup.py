"""magicdec/lookup.py: prompt-lookup proposals on hand-written token sequences (a match, none, several: the latest
wins, n backing off to shorter suffixes, the proposal cut at the sequence's end); greedy speculation with it equals
the plain autoregressive loop (B = 3, ragged); sampled speculation keeps the target's distribution."""
from __future__ import annotations


import pytest
import torch

from conftest import chi_square, prefill_copies
from magicdec.decoding.acceptance import Acceptor
from magicdec.model.forward_plan import LAST_LOGITS, NO_LOGITS
from magicdec.decoding.generate import Decoder, decode
from magicdec.model.kv_cache import KVCache
from magicdec.drafters.lookup import PromptLookup, propose_ngram
from magicdec.decoding.sampling import Sampling, probabilities
from test_generate_speculative import assert_ragged, plain_greedy


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def lookup(seq, gamma=3, ngram_max=2, pad=4):
    """One sequence, padded with junk (9s) past its end: what propose_ngram proposes and whether it matched."""
    ctx = torch.tensor([seq + [9] * pad])
    tokens, proposed = propose_ngram(ctx, torch.tensor([len(seq)]), gamma, ngram_max)
    return tokens[0].tolist(), int(proposed[0])


def test_a_match_is_continued():
    assert lookup([5, 6, 7, 8, 1, 5, 6]) == ([7, 8, 1], 3)


def test_the_latest_match_wins():
    assert lookup([1, 2, 3, 1, 2, 4, 0, 1, 2]) == ([4, 0, 1], 3)


def test_shorter_suffixes_when_the_longest_never_occurred():
    # [0, 3, 4] never occurred before; [3, 4] did (-> 8); with ngram_max 3
    assert lookup([3, 4, 8, 7, 0, 3, 4], ngram_max=3) == ([8, 7, 0], 3)
    # only the last token occurred before: 1-gram
    assert lookup([6, 2, 5, 7, 3, 2], ngram_max=3) == ([5, 7, 3], 3)


def test_the_longest_match_is_preferred_over_a_later_shorter_one():
    # suffix [1, 2]: at 0 (-> 3); the 1-gram [2] occurs later at 4 (-> 5), but the 2-gram is tried first
    assert lookup([1, 2, 3, 0, 2, 5, 1, 2]) == ([3, 0, 2], 3)


def test_no_match_repeats_the_last_token():
    assert lookup([1, 2, 3, 4]) == ([4, 4, 4], 0)


def test_a_proposal_stops_at_the_sequence_end():
    # [7, 8] at 2 is followed by 7, 8 and then the end: the rest repeats the last token, never the junk past it
    assert lookup([1, 2, 7, 8, 7, 8], gamma=4) == ([7, 8, 8, 8], 2)


def test_rows_are_independent():
    ctx = torch.tensor([[1, 2, 3, 1, 2, 0], [4, 4, 4, 4, 4, 4]])
    tokens, proposed = propose_ngram(ctx, torch.tensor([5, 2]), 2, 2)
    assert tokens.tolist() == [[3, 1], [4, 4]] and proposed.tolist() == [2, 1]  # row 2: only one token follows [4]


def test_branches_are_the_latest_occurrences_first():
    """[1, 2] occurred at 0 (-> 3, 4), at 3 (-> 5, 1) and ends the sequence: two branches, the latest first; a
    third branch where there is no third occurrence repeats the latest."""
    ctx = torch.tensor([[1, 2, 3, 4, 1, 2, 5, 1, 2, 9, 9]])
    tokens, proposed = propose_ngram(ctx, torch.tensor([9]), 2, 2, branches=3)
    assert tokens.tolist() == [[[5, 1], [3, 4], [5, 1]]] and proposed.tolist() == [2]
    one, _ = propose_ngram(ctx, torch.tensor([9]), 2, 2)
    assert one.tolist() == tokens[:, 0].tolist()  # the first branch is the chain's proposal


@pytest.mark.parametrize("gamma", [2, 4])
def test_lookup_branches_equal_plain_greedy(tiny, gamma):
    """Three earlier occurrences proposed as a tree's branches: the output is plain greedy decoding's."""
    prompts, n_new = repetitive_prompts(), 48
    a, B = tiny.args, prompts.shape[0]
    cache = KVCache(a.n_layers, B, a.n_kv_heads, 96 + n_new + 3 * gamma + 2, a.head_dim, torch.float32, "cpu")
    logits = tiny(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(96)
    lookup = PromptLookup(prompts, 3).shaped(3)
    decoder = Decoder(tiny, drafter=lookup, gamma=gamma)
    out, _ = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
    assert 0 < decoder.stats.alpha <= 1


def repetitive_prompts(B=3, P=96, seed=0):
    """Prompts made of a few repeated phrases, so suffixes recur and proposals are often right."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        phrases = [torch.randint(0, 256, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g) for _ in range(4)]
        row = torch.cat([phrases[int(i)] for i in torch.randint(0, 4, (40,), generator=g)])
        rows.append(row[:P])
    return torch.stack(rows)


@pytest.mark.parametrize("gamma", [2, 4])
def test_lookup_speculation_equals_plain_greedy(tiny, gamma):
    prompts, n_new = repetitive_prompts(), 48
    a, B = tiny.args, prompts.shape[0]
    cache = KVCache(a.n_layers, B, a.n_kv_heads, 96 + n_new + gamma + 2, a.head_dim, torch.float32, "cpu")
    logits = tiny(prompts, cache, LAST_LOGITS)[:, -1]
    cache.advance(96)
    decoder = Decoder(tiny, drafter=PromptLookup(prompts, 3), gamma=gamma, trace=True)
    out, counts = decode(decoder, cache, logits.argmax(-1), n_new, prev=prompts[:, -1])
    assert out.tolist() == plain_greedy(tiny, prompts, n_new).tolist()
    assert_ragged(decoder)
    assert 0 < decoder.stats.alpha < 1


POINT_MASS_COPIES = 4_000


def point_mass_prompt() -> torch.Tensor:
    """One repetitive prompt [1, 96] whose last token occurred before: a text drafter proposes what followed it."""
    return repetitive_prompts(1, 96, seed=3)


def sampled_second_tokens(tiny, prompt: torch.Tensor, make_draft, seed: int = 0):
    """POINT_MASS_COPIES copies of `prompt` (its KV copied to every row), two tokens decoded at T 0.6, top-p 0.9 with
    the drafter make_draft(copies) drafting one token: (the second token of each row [N], the drafter)."""
    N, a = POINT_MASS_COPIES, tiny.args
    torch.manual_seed(seed)
    cache = KVCache(a.n_layers, N, a.n_kv_heads, 100, a.head_dim, torch.float32, "cpu")
    prefill_copies(tiny, cache, prompt.expand(N, -1), 96)
    draft = make_draft(prompt.expand(N, -1))
    last = prompt[:, -1].expand(N)  # the first token: a repeat, so it matches
    out, _ = decode(Decoder(tiny, Acceptor(Sampling(0.6, 0.9)), drafter=draft, gamma=1), cache, last, 2, prev=last)
    return out[:, 1], draft


def second_token_distribution(tiny, prompt: torch.Tensor) -> torch.Tensor:
    """The target's distribution (T 0.6, top-p 0.9) after `prompt` and a repeat of its last token [V], float64."""
    a = tiny.args
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, 100, a.head_dim, torch.float32, "cpu")
    tiny(prompt, cache, NO_LOGITS)
    cache.advance(96)
    return probabilities(tiny(prompt[:, -1:], cache)[:, -1], 0.6, 0.9)[0].double()


def keep_every_drafted(p, q, drafted):
    """A chain verifier that never rejects (it hands out the point mass itself): the control the checks must fail."""
    from magicdec.decoding.sampling import sample_from

    return torch.full((drafted.shape[0],), drafted.shape[1]), sample_from(p[:, -1])


def test_sampled_lookup_keeps_the_targets_distribution(tiny, monkeypatch):
    """N copies of a prompt whose last token occurred before: the first drafted token is the one that followed it,
    a point mass; the token sampled at that position must still follow the target's own distribution (chi-square
    below its 1 - 3e-7 quantile, nothing outside top-p); a verifier that never rejects fails it."""
    from magicdec.decoding import acceptance

    prompt = point_mass_prompt()
    vocab = tiny.args.vocab_size

    def second_tokens():
        tokens, draft = sampled_second_tokens(tiny, prompt, lambda copies: PromptLookup(copies, 3, vocab))
        assert bool((draft.proposed == 1).all())
        return tokens

    p = second_token_distribution(tiny, prompt)
    stat, bound = chi_square(second_tokens(), p)
    assert stat < bound, (stat, bound)
    monkeypatch.setattr(acceptance, "speculative_sampling_verify", keep_every_drafted)
    stat, bound = chi_square(second_tokens(), p)
    assert stat > 2 * bound, (stat, bound)


def test_rows_with_nothing_to_copy_propose_nothing():
    tokens, _ = PromptLookup(torch.tensor([[1, 2, 3], [4, 5, 6]]), 2).propose(None, torch.tensor([[3, 7], [6, 8]]),
                                                                              torch.tensor([2, 2]), None, 3)
    assert tokens.shape == (2, 0)


def test_nothing_proposed_costs_one_plain_step(tiny, monkeypatch):
    """Prompts whose tokens never repeat, and a target that continues with tokens not in them: no suffix ever
    matches, so every verification feeds the target one token, as the plain loop does, and yields its token."""
    prompts, n_new, a = torch.arange(96).view(3, 32), 12, tiny.args
    fed = []
    forward = type(tiny).forward

    def counting(self, tokens, *rest, **kw):
        fed.append(tokens.shape[1])
        return forward(self, tokens, *rest, **kw)

    def fresh(k):  # the target's argmax never repeats a token: the first time step k's token is 100 + k
        logits = torch.full((prompts.shape[0], 1, a.vocab_size), -1e9)
        logits[..., 100 + k] = 0
        return logits

    monkeypatch.setattr(type(tiny), "forward", counting)
    cache = KVCache(a.n_layers, 3, a.n_kv_heads, 32 + n_new + 5, a.head_dim, torch.float32, "cpu")
    tiny(prompts, cache, NO_LOGITS)
    cache.advance(32)
    fed.clear()
    from magicdec.decoding import generate
    steps = iter(range(1, 100))
    monkeypatch.setattr(generate.tp, "vocab_argmax", lambda logits, shard: fresh(next(steps)).argmax(-1))
    decoder = Decoder(tiny, drafter=PromptLookup(prompts, 3), gamma=3)
    out, _ = decode(decoder, cache, torch.full((3,), 100), n_new, prev=prompts[:, -1])
    assert out[0].tolist() == list(range(100, 100 + n_new)) and fed == [1] * (n_new - 1)
    assert decoder.stats.drafted == 0 and decoder.stats.iterations == n_new - 1


def first_proposal(seq: list[int], ngram_max: int):
    """A plain-Python reference: the token after the latest earlier occurrence of the longest suffix, or None."""
    for n in range(min(ngram_max, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        for s in range(len(seq) - n - 1, -1, -1):
            if seq[s:s + n] == tail:
                return seq[s + n]
    return None


def test_lookup_teacher_forced_counts(tiny):
    """benchmarks/lookup_alpha.py against the reference: positions with a proposal, and those whose proposal is the
    target's own top-1 (the book is the target's greedy continuation, so top-1 is the book's next token)."""
    from conftest import benchmark_script

    lookup_alpha = benchmark_script("lookup_alpha")
    prompts = repetitive_prompts(2, 64, seed=7)
    book = plain_greedy(tiny, prompts, 12)
    text = torch.cat([prompts, book], 1)
    a = tiny.args
    cache = KVCache(a.n_layers, 2, a.n_kv_heads, 76, a.head_dim, torch.float32, "cpu")
    tiny(text, cache, NO_LOGITS)  # the script's prefill: the prompt with the book, which it rolls back
    cache.advance(76)
    got = lookup_alpha.teacher_forced(tiny, cache, text, 64, 3)
    assert cache.lengths.tolist() == [64, 64]  # left at the prompt's end
    text = text.tolist()
    proposals = [first_proposal(row[:64 + t], 3) for row in text for t in range(12)]
    nexts = [row[64 + t] for row in text for t in range(12)]
    assert got["positions"] == 24 and got["proposed"] == sum(x is not None for x in proposals)
    assert got["top1"] == sum(x == y for x, y in zip(proposals, nexts))
    assert 0 < got["top1"] and 0 < got["min_pq"] <= got["proposed"]


def test_under_synthetic_acceptance_every_row_proposes_gamma():
    """A random-weight speed run's acceptance is the synthetic rule's: the random model's text must not decide how
    many tokens are drafted, so rows with nothing to copy propose gamma tokens (their last token repeated)."""
    drafter = PromptLookup(torch.tensor([[1, 2, 3], [4, 5, 6]]), 2, full=True)
    tokens, _ = drafter.propose(None, torch.tensor([[3, 7], [6, 8]]), torch.tensor([2, 2]), None, 3)
    assert tokens.tolist() == [[7, 7, 7], [8, 8, 8]] and drafter.proposed.tolist() == [3, 3]


def test_a_synthetic_lookup_run_drafts_gamma_every_verification():
    from magicdec import cli
    from conftest import TINY_RUN
    record = cli.run_record([*TINY_RUN, "--gen_len", "24", "--drafter", "lookup", "--gamma", "3",
                             "--synthetic_acceptance", "0.6"])
    s = record["metrics"]["speculation"]
    assert s["draft_steps"] == 3 * s["iterations"] > 0


def test_a_branch_tree_is_predicted_at_its_node_count_and_branch_rates(tmp_path):
    """Above width 1 the verification takes every branch: T_V at width * gamma + 1 tokens (a chain's gamma + 1),
    and the tokens kept by hand for two branches of 2 at rates (a, s): the first branch's chain a (1 + a), else the
    second branch at s, its second token at a."""
    import json
    from magicdec.analysis import cost_model as cm
    from magicdec.drafters.lookup import DRAFTER
    from magicdec.harness import plan_command
    from magicdec.config import ModelArgs
    a, s = 0.6, 0.3
    rates = tmp_path / "acceptance.json"
    rates.write_text(json.dumps({"lookup": {"alpha": a, "siblings": [s]}}))
    point = {"random_weights": True, "model_name": "JackFram/llama-68m", "B": 2, "prefix_len": 300, "gen_len": 10,
             "device": "cpu", "dtype": "float32"}
    planner = plan_command.Planner(point, plan_command.Inputs(cm.PROFILES / "h100.json", rates, gammas=(2,),
                                                              synthetic=True))
    cfg = planner.config("lookup", {"ngram_max": 2, "tree_width": 2}, 2, shaped=True)
    target = ModelArgs.from_name("JackFram/llama-68m")
    device = cm.Device(3e12, 7e14, 60e-6)
    p = DRAFTER.predict(cfg, target, None, device, a, 2, 0)
    assert p["T_V"] == pytest.approx(cm.step_time(target, device, 2, 305, 5))
    assert p["omega"] == pytest.approx(1 + a * (1 + a) + (1 - a) * s * (1 + a))
    chain = DRAFTER.predict(planner.config("lookup", {"ngram_max": 2}, 2, shaped=True), target, None, device, a, 2, 0)
    assert chain["T_V"] == pytest.approx(cm.step_time(target, device, 2, 305, 3))
