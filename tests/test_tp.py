"""Tensor parallelism (magicdec/model/tp.py): shards cover every weight exactly once, and `torchrun --nproc_per_node=2`
on the CPU (gloo) produces the same greedy tokens as one process — baseline, self-speculation on a model whose 3 KV
heads split 2 + 1, and a standalone draft running on 1 of the 2 ranks."""
import json
from pathlib import Path

import pytest
import torch

from conftest import BOOKS, REPO, needs_smollm2, one_line_error, run_cli
from magicdec.model import tp
from magicdec.model.checkpoint import expected_shapes
from magicdec.config import ModelArgs


@pytest.mark.parametrize("n,parts", [(8, 2), (3, 2), (7, 3), (4, 4)])
def test_even_split_covers_everything_once(n, parts):
    pieces = [tp.even_split(n, parts, i) for i in range(parts)]
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert max(e - s for s, e in pieces) - min(e - s for s, e in pieces) <= 1


@pytest.mark.parametrize("size", [2, 3])
def test_shards_reassemble_every_tensor(size):
    """Concatenating the ranks' slices along the split axis gives back each checkpoint tensor; KV heads of 3 split
    unevenly, and every query head lands with its KV head."""
    args = ModelArgs(vocab_size=101, dim=48, n_layers=1, n_heads=6, n_kv_heads=3, intermediate_size=50,
                     attention_bias=True)
    shards = [tp.Shard(i, size, None, tp.even_split(3, size, i), tp.even_split(50, size, i),
                       tp.even_split(101, size, i), -(-101 // size)) for i in range(size)]
    for name, shape in expected_shapes(args).items():
        full = torch.randn(shape)
        parts = [tp.slice_tensor(name, full, args, s) for s in shards]
        axis = 1 if name.endswith(("wo.weight", "w2.weight")) else 0
        if all(p.shape == full.shape for p in parts):  # replicated
            assert all(torch.equal(p, full) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, axis), full), name
    # query rows of KV head h are rows [h*G*D, (h+1)*G*D): the rank holding KV heads kv0..kv1 holds exactly those
    g, d = 2, 8
    for s in shards:
        q = tp.slice_tensor("layers.0.attention.wq.weight", torch.arange(48)[:, None].float(), args, s)
        assert q[:, 0].tolist() == list(range(s.kv[0] * g * d, s.kv[1] * g * d))


def run_json(out: Path, script: str, *argv, launcher=()):
    p = run_cli(REPO / "tests" / script, "--save_tokens", "--output", str(out), *argv, launcher=launcher)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def run_here_json(out: Path, script: str, *argv):
    """One process's run, in this one: the script's run() (what its __main__ runs), its record as written."""
    import importlib

    importlib.import_module(script.removesuffix(".py")).run(
        ["--device", "cpu", "--no_progress", "--save_tokens", "--output", str(out), *argv])
    return json.loads(out.read_text())


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def same_tokens(tmp_path, script, *argv):
    one = run_here_json(tmp_path / "one.json", script, *argv)
    two = run_json(tmp_path / "two.json", script, "--rank_group", "0", "1", *argv, launcher=TORCHRUN)
    assert two["generated_ids"] == one["generated_ids"]
    assert two["tensor_parallel"]["world"] == 2
    # the seed's ENABLE_INTRA_NODE_COMM=1 (set in run_cli's env below) falls back to gloo on the CPU, and says so
    assert two["tensor_parallel"]["all_reduce"] == "gloo (symmetric memory needs CUDA)"
    assert all(m and m > 0 for m in two["tensor_parallel"]["peak_memory_GiB_per_rank"])
    return one, two


LLAMA68M = ("--random_weights", "--model_name", "JackFram/llama-68m", "--B", "2", "--prefix_len", "160", "--gen_len", "16")


def test_baseline_two_ranks(tmp_path):
    same_tokens(tmp_path, "baseline_benchmark.py", *LLAMA68M)


@needs_smollm2
@pytest.mark.parametrize("policy", ["streaming", "snapkv"])
def test_selfspec_two_ranks_uneven_kv_heads(tmp_path, smol_dir, monkeypatch, policy):
    """SmolLM2 has 3 KV heads: rank 0 holds 2 of them (6 query heads), rank 1 holds 1 (3 query heads). SnapKV
    selects per KV head from each rank's own heads, so the two ranks together keep what one process keeps."""
    monkeypatch.setenv("MAGICDEC_CACHE", str(smol_dir.parent))
    one, two = same_tokens(tmp_path, "selfspec_benchmark.py", "--B", "2", "--prefix_len", "200", "--gen_len", "20",
                           "--dataset", str(BOOKS), "--streamingllm_budget", "64", "--gamma", "3",
                           "--draft_policy", policy)
    assert 0 < one["metrics"]["alpha"] < 1  # real, ragged speculation, not a trivial case
    assert two["metrics"]["alpha"] == one["metrics"]["alpha"]  # the same drafts accepted: the same selection


@pytest.mark.parametrize("budget", ["0", "64"])
def test_standalone_draft_on_one_of_two_ranks(tmp_path, budget):
    """The draft runs on rank 0 alone and broadcasts its tokens; budget 0 gives it the target's weights and a full
    cache, so everything is accepted."""
    one, two = same_tokens(tmp_path, "longspec_benchmark.py", *LLAMA68M, "--draft_name", "JackFram/llama-68m",
                           "--draft_ranks", "0", "--streamingllm_budget", budget, "--gamma", "3")
    assert two["tensor_parallel"]["drafter"]["draft_ranks"] == [0]
    if budget == "0":
        assert one["metrics"]["alpha"] == 1.0 and two["metrics"]["alpha"] == 1.0


def test_rank_group_must_match_the_launch(tmp_path):
    one_line_error(run_cli(REPO / "tests" / "baseline_benchmark.py", *LLAMA68M, "--rank_group", "0", "1"),
                   "needs 2 processes", "torchrun --nproc_per_node=2")


def _argmax_worker(rank, init_file, logits, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    V = logits.shape[-1]
    lo, hi = tp.even_split(V, 2, rank)
    shard = tp.Shard(rank, 2, dist.group.WORLD, (0, 1), (0, 1), (lo, hi), -(-V // 2))
    out[rank] = tp.vocab_argmax(logits[..., lo:hi], shard)
    dist.destroy_process_group()


def test_vocab_argmax_equals_argmax_on_full_logits(tmp_path):
    """Two gloo processes each hold half of a 7-token vocabulary (4 + 3); ties inside a shard and across the shard
    boundary resolve to the lowest index, like torch.argmax on the full logits."""
    import torch.multiprocessing as mp

    logits = torch.tensor([[[0.0, 5.0, 1.0, 2.0, 5.0, 0.0, 1.0],    # tie across shards -> 1
                            [0.0, 1.0, 2.0, 3.0, 3.0, 9.0, 9.0],    # tie inside shard 1 -> 5
                            [7.0, 1.0, 7.0, 0.0, 0.0, 0.0, 0.0]]])  # tie inside shard 0 -> 0
    logits = torch.cat([logits, torch.randn(1, 5, 7)], dim=1)
    out = mp.Manager().dict()
    mp.spawn(_argmax_worker, args=(str(tmp_path / "init"), logits, out), nprocs=2)
    expected = logits.argmax(-1)
    assert out[0].tolist() == out[1].tolist() == expected.tolist()
    assert expected[0, :3].tolist() == [1, 5, 0]


def test_hierarchy_two_ranks(tmp_path):
    """--hierarchy under tensor parallelism: the bottom model runs on rank 0 and broadcasts its tokens, the middle
    (the sharded target over its retrieval cache) and the target verify on both; the tokens of one process."""
    one, two = same_tokens(tmp_path, "selfspec_benchmark.py", *LLAMA68M, "--draft_policy", "retrieval",
                           "--draft_budget", "64", "--gamma", "4", "--hierarchy", "--draft_name", "JackFram/llama-68m",
                           "--gamma_bottom", "2", "--bottom_budget", "32", "--sinks", "4")
    levels = [r["metrics"]["speculation"]["drafter"] for r in (one, two)]
    assert levels[0]["alpha_bottom_to_middle"] == levels[1]["alpha_bottom_to_middle"]


def test_offloaded_target_two_ranks(tmp_path):
    """--offload under tensor parallelism: each rank offloads its own KV heads (the layers beyond --on_chip); the
    tokens of one process."""
    one, two = same_tokens(tmp_path, "selfspec_benchmark.py", *LLAMA68M, "--streamingllm_budget", "64", "--gamma", "3",
                           "--offload", "--on_chip", "1")
    assert two["offload"]["offloaded_layers"] == 1


def test_a_shard_of_random_weights_holds_only_its_slices():
    """Random weights are made whole and sliced per rank: every tensor a rank keeps owns exactly its own bytes (a
    slice kept as a view kept the whole tensor, so each rank held the whole model beside its shard); the slices'
    values are test_shards_reassemble_every_tensor's."""
    from magicdec.model.transformer import build_model

    args = ModelArgs(vocab_size=101, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, intermediate_size=50)
    shard = tp.Shard(1, 2, None, tp.even_split(2, 2, 1), tp.even_split(50, 2, 1), tp.even_split(101, 2, 1), 51)
    part = build_model(args, "cpu", torch.float32, random_seed=3, shard=shard)
    whole = sum(t.numel() for t in build_model(args, "cpu", torch.float32, random_seed=3).state_dict().values())
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in part.state_dict().values()}
    for name, t in part.state_dict().items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    assert sum(kept.values()) < 0.7 * whole * 4  # half the layers' matrices, the embeddings and norms whole
