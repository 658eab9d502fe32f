"""benchmarks/gpt_fast_peer.py on the CPU. gpt-fast's own model.py, holding magicdec's weights as the benchmark maps
them, gives magicdec's logits (and without the q/k reordering it does not); gpt-fast's decode and speculative loops,
driven as the benchmark drives them, make magicdec's greedy tokens. Those need a gpt-fast checkout: $GPT_FAST_DIR (a
clone of https://github.com/pytorch-labs/gpt-fast), else this workspace's mirror of it beside the repository; without
one they skip, saying so. Everywhere: the q/k reordering against transformers' RoPE and the complex-number rotation
gpt-fast's layout takes, the rounds' bookkeeping (order, paired ratios, acceptance, bandwidth) from runs of set
durations, and the one-line errors for bad input."""
from __future__ import annotations

import os
import statistics
import subprocess

import pytest
import torch

from conftest import REPO, benchmark_script, randomize_
from magicdec.config import ModelArgs
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Decoder, prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.transformer import build_model

peer = benchmark_script("gpt_fast_peer")
MIRROR = REPO.parent / ".mirror" / "pytorch-labs+gpt-fast" / "repo"  # this workspace's bare mirror of gpt-fast
# the last gpt-fast commit whose speculative_decode runs at batch 1 (its batched generation, 61c193d, broke it)
SPECULATIVE_COMMIT = "bc04265"
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}  # wavelengths on each side of llama3's band and inside it
TARGET = ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                   rope_base=500000.0, rope_scaling=ROPE, max_seq_len=256, name="tiny-target")
DRAFT = ModelArgs(vocab_size=256, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=48,
                  rope_base=500000.0, rope_scaling=ROPE, max_seq_len=256, tie_embeddings=True, name="tiny-draft")


def archive(git_dir, commit: str, into) -> bool:
    """`git archive COMMIT` of a clone or bare mirror unpacked into `into`; False where git cannot."""
    into.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(f"git -C '{git_dir}' archive {commit} | tar -x -C '{into}'", shell=True,
                          capture_output=True)
    return made.returncode == 0 and (into / "generate.py").is_file()


@pytest.fixture(scope="module")
def gpt_fast(tmp_path_factory):
    """A gpt-fast checkout: $GPT_FAST_DIR, else the workspace mirror's HEAD; skipped, saying why, without one."""
    given = os.environ.get("GPT_FAST_DIR")
    if given:
        return peer.check_checkout(peer.Path(given), "GPT_FAST_DIR")  # set but wrong: an error, not a skip
    folder = tmp_path_factory.mktemp("gpt_fast_head")
    if MIRROR.is_dir() and archive(MIRROR, "HEAD", folder):
        return folder
    pytest.skip("no gpt-fast checkout: set GPT_FAST_DIR to a clone of https://github.com/pytorch-labs/gpt-fast")


@pytest.fixture(scope="module")
def gpt_fast_speculative(tmp_path_factory, gpt_fast):
    """gpt-fast at SPECULATIVE_COMMIT: $GPT_FAST_SPECULATIVE_DIR, else archived from $GPT_FAST_DIR's git or the
    mirror."""
    given = os.environ.get("GPT_FAST_SPECULATIVE_DIR")
    if given:
        return peer.check_checkout(peer.Path(given), "GPT_FAST_SPECULATIVE_DIR")
    folder = tmp_path_factory.mktemp("gpt_fast_speculative")
    for git_dir in (os.environ.get("GPT_FAST_DIR"), MIRROR):
        if git_dir and peer.Path(git_dir).is_dir() and archive(git_dir, SPECULATIVE_COMMIT, folder):
            return folder
    pytest.skip(f"no gpt-fast checkout at {SPECULATIVE_COMMIT} (its speculative_decode runs at batch 1): set "
                "GPT_FAST_SPECULATIVE_DIR, or GPT_FAST_DIR to a git clone holding that commit")


def tiny(args: ModelArgs, seed: int):
    """magicdec's model at `args` with magicdec's random weights, spread wider (conftest.randomize_: logits far
    from ties, norm weights off 1 so a misplaced norm shows)."""
    model = build_model(args, "cpu", torch.float32, random_seed=seed)
    randomize_(model, seed + 1)
    return model


def magicdec_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Every position's logits of `tokens` [1, T], then the next token's (the argmax) at position T."""
    a = model.args
    cache = KVCache(a.n_layers, 1, a.n_kv_heads, tokens.shape[1] + 1, a.head_dim, torch.float32, "cpu", "sdpa")
    with torch.no_grad():
        logits = model(tokens, cache)
        cache.advance(tokens.shape[1])
        after = model(logits[:, -1:].argmax(-1), cache)
    return torch.cat([logits, after], 1)


def gpt_fast_logits(transformer, tokens: torch.Tensor) -> torch.Tensor:
    T = tokens.shape[1]
    transformer.setup_caches(max_batch_size=1, max_seq_length=T + 1)
    with torch.no_grad():
        logits = transformer(tokens, torch.arange(T))
        after = transformer(logits[:, -1:].argmax(-1), torch.tensor([T]))
    return torch.cat([logits, after], 1)


# ---------------------------------------------------------------- the mapping against gpt-fast's own model

@pytest.mark.parametrize("args", [TARGET, DRAFT], ids=["gqa", "tied_embeddings"])
def test_gpt_fast_model_gives_magicdec_logits(gpt_fast, args):
    model = tiny(args, seed=3)
    tokens = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    ours = magicdec_logits(model, tokens)
    mapped = peer.GptFastModel(gpt_fast)
    theirs = gpt_fast_logits(mapped.transformer(model), tokens)
    assert ours.abs().max() > 1  # logits with room to differ
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    # the same tensors without the q/k reordering: gpt-fast's interleaved RoPE rotates other pairs, the logits differ
    unordered = mapped.module.Transformer(peer.gpt_fast_args(mapped.module, args, "test"))
    unordered.load_state_dict(model.state_dict(), strict=True)
    assert (gpt_fast_logits(unordered.eval(), tokens) - ours).abs().max() > 1e-2


def test_gpt_fast_settings_stay_with_gpt_fast(gpt_fast):
    """Importing generate.py sets inductor's options; they are put back for magicdec and kept for gpt-fast's calls."""
    import torch._inductor.config as inductor

    before = inductor.get_config_copy()
    driver = peer.GptFast(gpt_fast, peer.GptFastModel(gpt_fast))
    assert inductor.get_config_copy() == before
    assert driver.settings["torch._inductor.config"]["coordinate_descent_tuning"] is True
    with driver.own_settings():
        assert inductor.coordinate_descent_tuning is True
    assert inductor.get_config_copy() == before


# ---------------------------------------------------------------- gpt-fast's loops as the benchmark drives them

P, N, GAMMA = 20, 12, 3


@pytest.fixture(scope="module")
def greedy():
    """A prompt, the tiny target and draft, and magicdec's greedy tokens (its plain decode: the reference)."""
    target, draft = tiny(TARGET, seed=5), tiny(DRAFT, seed=7)
    prompts = torch.randint(0, TARGET.vocab_size, (1, P), generator=torch.Generator().manual_seed(1))
    cache = KVCache(TARGET.n_layers, 1, TARGET.n_kv_heads, P + N + 2, TARGET.head_dim, torch.float32, "cpu", "sdpa")
    with torch.no_grad():
        first = prefill(target, cache, prompts, 8).argmax(-1)
        out, counts = Decoder(target).generate(cache, first, N, prev=prompts[:, -1])
    assert counts.tolist() == [N]
    return target, draft, prompts, out[0].tolist()


def test_gpt_fast_decode_makes_magicdecs_tokens(gpt_fast, greedy):
    target, _, prompts, expected = greedy
    model = peer.GptFastModel(gpt_fast)
    driver = peer.GptFast(gpt_fast, model)
    transformer = model.transformer(target)
    transformer.setup_caches(max_batch_size=1, max_seq_length=P + N)
    first = driver.prefill(transformer, prompts, chunk=8)  # in chunks: its forward at any positions
    run = driver.decode(transformer, first, P, N, torch.device("cpu"))
    assert run.tokens == expected
    assert run.decoded == N - 1 and run.seconds > 0 and run.verifications is None


@pytest.mark.parametrize("draft_is_target", [True, False], ids=["draft_is_target", "independent_draft"])
def test_gpt_fast_speculation_makes_magicdecs_tokens(gpt_fast, gpt_fast_speculative, greedy, draft_is_target):
    target, draft, prompts, expected = greedy
    model = peer.GptFastModel(gpt_fast)  # HEAD's model.py, the older generate.py: as --gpt_fast_speculative runs
    driver = peer.GptFast(gpt_fast_speculative, model, "speculative")
    pair = [model.transformer(target), model.transformer(target if draft_is_target else draft)]
    for transformer in pair:
        transformer.setup_caches(max_batch_size=1, max_seq_length=P + N + GAMMA + 1)
    first = [driver.prefill(t, prompts, chunk=8) for t in pair][0]
    run = driver.speculate(*pair, first, P, N, GAMMA, torch.device("cpu"))
    assert run.tokens == expected  # greedy speculation is lossless
    assert run.decoded == N - 1
    assert run.examined <= GAMMA * run.verifications
    if draft_is_target:  # every drafted token kept: the N - 1 tokens in verifications of GAMMA + 1
        assert run.accepted == run.examined and run.verifications == -(-(N - 1) // (GAMMA + 1))
    else:
        assert run.verifications > -(-(N - 1) // (GAMMA + 1))


# ---------------------------------------------------------------- the reordering against independent references

def test_reordered_rows_rotate_as_interleaved_rope():
    """interleaved_qk's rows, rotated pair (2i, 2i + 1) by pair as complex numbers (Meta's reference RoPE, gpt-fast's
    layout), give transformers' rotate-half RoPE of the original rows, reordered alike: so q . k is unchanged."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    H, Hkv, D, dim, T = 4, 2, 8, 16, 6
    gen = torch.Generator().manual_seed(0)
    w = torch.randn((H + 2 * Hkv) * D, dim, generator=gen, dtype=torch.float64)
    x = torch.randn(T, dim, generator=gen, dtype=torch.float64)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)  # [T, D/2]

    def heads(rows, n):  # x's projection by `rows` as [n, T, D]
        return (x @ rows.T).view(T, n, D).transpose(0, 1)

    q, k, _ = w.split([H * D, Hkv * D, Hkv * D])
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    hf_q, hf_k = apply_rotary_pos_emb(heads(q, H)[None], heads(k, Hkv)[None], cos, sin)
    gq, gk, gv = peer.interleaved_qk(w, H, Hkv, D).split([H * D, Hkv * D, Hkv * D])

    def complex_rope(t):  # [n, T, D] rotated as D/2 complex numbers (2i, 2i + 1)
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], D // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)

    order = torch.arange(D).view(2, D // 2).T.flatten()  # gpt-fast's dimension 2i + j is transformers' j * D/2 + i
    torch.testing.assert_close(complex_rope(heads(gq, H)), hf_q[0][..., order])
    torch.testing.assert_close(complex_rope(heads(gk, Hkv)), hf_k[0][..., order])
    assert torch.equal(gv, w[(H + Hkv) * D:])
    def scores(q, k):  # each query head against its KV head's keys
        return q.view(Hkv, H // Hkv, T, D) @ k[:, None].transpose(-1, -2)

    torch.testing.assert_close(scores(complex_rope(heads(gq, H)), complex_rope(heads(gk, Hkv))),
                               scores(hf_q[0], hf_k[0]))


# ---------------------------------------------------------------- the rounds' bookkeeping, from set durations

def runs(pairs, tokens=None):
    """Runs of (seconds, decoded tokens)."""
    return [peer.Run(s, d, tokens or [0]) for s, d in pairs]


def test_rounds_alternate_which_engine_runs_first():
    order = []

    def runner(name, seconds):
        def run():
            order.append(name)
            return peer.Run(seconds[len([o for o in order if o == name]) - 1], 10, [])
        return run

    out = peer.interleaved_rounds({"gpt-fast": runner("gpt-fast", [1, 2, 3]),
                                   "magicdec": runner("magicdec", [4, 5, 6])}, 3)
    assert order == ["gpt-fast", "magicdec", "magicdec", "gpt-fast", "gpt-fast", "magicdec"]
    assert [r.seconds for r in out["gpt-fast"]] == [1, 2, 3] and [r.seconds for r in out["magicdec"]] == [4, 5, 6]


def test_ratio_is_the_median_of_each_rounds_rate_ratio():
    theirs = runs([(1.0, 100), (1.0, 90), (1.0, 110)])  # 100, 90, 110 tokens/s
    ours = runs([(0.5, 100), (0.9, 90), (1.0, 150)])  # 200, 100, 150 tokens/s: one round decoded more
    ratio = peer.paired_ratio(ours, theirs)
    assert ratio["per_round"] == pytest.approx([2.0, 100 / 90, 150 / 110])
    assert ratio["median"] == pytest.approx(150 / 110)  # not the medians' ratio (1.5), nor by seconds (1.11)
    assert (ratio["min"], ratio["max"]) == pytest.approx((100 / 90, 2.0))


def test_acceptance_counts_examined_positions_as_magicdec_does():
    assert peer.counted([0, 2, 3, 1], gamma=3) == (4, 6, 1 + 3 + 3 + 2)
    a = peer.acceptance([peer.Run(1.0, 5, [], 4, 6, 9), peer.Run(1.0, 5, [], 2, 0, 2)])
    assert a == {"verifications": 6, "accepted_tokens": 6, "alpha": 6 / 11, "tokens_per_verification": 12 / 6}


class Weights:
    """A model's two numbers bandwidth_metrics reads."""
    n_kv_heads = 2

    def weight_bytes(self) -> int:
        return 1000


def test_bandwidth_is_bytes_per_step_over_step_time_against_copy():
    config = ModelArgs(vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=2, intermediate_size=8)  # head_dim 4
    # per token of KV: 2 layers x (K, V) x 2 heads x 4 dims x 2 bytes = 64; gen_len 3: 2 steps reading 11 and 12
    # positions, 11.5 on average: 736 bytes, + 1000 of weights = 1736 per step
    out = peer.bandwidth(Weights(), config, 10, 3, torch.bfloat16, runs([(2.0, 2), (4.0, 2)]), copy_bw=3472.0)
    assert out["bytes_per_step"] == 1736
    assert out["fraction_of_copy_per_round"] == pytest.approx([0.5, 0.25])
    assert out["fraction_of_copy_median"] == pytest.approx(0.375)
    assert out["achieved_GBps_per_round"] == pytest.approx([1736 / 1e9, 868 / 1e9])


def test_phase_record_pairs_rounds_and_compares_tokens():
    theirs = [peer.Run(1.0, 4, [7, 1, 2, 3, 4], 2, 1, 3), peer.Run(2.0, 4, [7, 1, 2, 3, 4], 2, 1, 3),
              peer.Run(1.0, 4, [7, 1, 2, 3, 4], 2, 1, 3)]
    ours = [peer.Run(0.5, 4, [7, 1, 2, 9, 9], 2, 0, 2), peer.Run(0.5, 4, [7, 1, 2, 9, 9], 2, 0, 2),
            peer.Run(0.25, 4, [7, 1, 2, 9, 9], 2, 0, 2)]
    record = peer.phase_record(4096, "speculative", {"gpt-fast": theirs, "magicdec": ours},
                               {"gpt-fast": 30.0, "magicdec": 2.0}, bandwidth_of=lambda r: len(r))
    assert record["magicdec_over_gpt_fast"]["per_round"] == pytest.approx([2.0, 4.0, 4.0])
    assert record["magicdec_over_gpt_fast"]["median"] == pytest.approx(4.0)
    assert record["agreement"] == {"first_token_equal": True, "common_prefix_tokens": 3, "of": 5}
    gf, md = record["engines"]["gpt-fast"], record["engines"]["magicdec"]
    assert gf["round_tokens_per_s"] == [4.0, 2.0, 4.0] and gf["median_tokens_per_s"] == 4.0
    assert gf["first_run_less_median_s"] == pytest.approx(30.0 - statistics.median([1.0, 2.0, 1.0]))
    assert gf["acceptance"]["alpha"] == pytest.approx(3 / 9) and md["acceptance"]["alpha"] == 0.0
    assert gf["bandwidth"] == 3 and md["graphs_compiled_while_timed"] == [0, 0, 0]


# ---------------------------------------------------------------- bad input: one line, before anything loads

def fake_checkout(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("generate.py", "model.py"):
        (folder / name).write_text("raise RuntimeError('must not be imported by a failing check')\n")
    return folder


def main_error(*argv) -> str:
    with pytest.raises(MagicDecError) as e:
        peer.main([*map(str, argv)])
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_input_is_one_line(tmp_path):
    out = ("--output", tmp_path / "out")
    assert "--gpt_fast" in main_error("--gpt_fast", tmp_path / "nowhere", *out) and "no such folder" in \
        main_error("--gpt_fast", tmp_path / "nowhere", *out)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.py").write_text("")
    assert "has no generate.py" in main_error("--gpt_fast", tmp_path / "half", *out)
    fake = fake_checkout(tmp_path / "fake")
    assert "pass --gpt_fast_commit" in main_error("--gpt_fast", fake, *out)
    assert "--rounds 2" in main_error("--gpt_fast", fake, "--gpt_fast_commit", "abc123", "--rounds", "2", *out)
    assert "--gpt_fast_speculative" in main_error("--gpt_fast", fake, "--gpt_fast_commit", "abc123",
                                                  "--gpt_fast_speculative", tmp_path / "nowhere", *out)
    if not torch.cuda.is_available():
        assert "no CUDA device" in main_error("--gpt_fast", fake, "--gpt_fast_commit", "abc123", *out)
    assert not (tmp_path / "out").exists()  # nothing made before the checks passed


def test_commit_is_read_from_the_checkouts_own_git(tmp_path):
    repo = fake_checkout(tmp_path / "repo")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, check=True, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert peer.checkout_commit(repo.resolve(), None) == (head, "git rev-parse HEAD in --gpt_fast")
    assert peer.checkout_commit(repo.resolve(), head[:7])[0] == head
    with pytest.raises(MagicDecError, match="contradicts"):
        peer.checkout_commit(repo.resolve(), "0123456")
    inner = fake_checkout(repo / "inner")  # inside a repository, not one: its commit is not that repository's
    with pytest.raises(MagicDecError, match="pass --gpt_fast_commit"):
        peer.checkout_commit(inner.resolve(), None)
