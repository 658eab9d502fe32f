"""Hydra as a drafter (magicdec/drafters/hydra.py): greedy speculation equals a plain autoregressive loop (chain
and tree, ragged), sampled speculation keeps the target's distribution, and a drafted chain is what each head says
given the path before it, computed by hand from the saved state dict."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_generate_speculative import plain_greedy, tiny_prompts
from test_medusa import check_greedy, check_sampled, shaped

from magicdec.model import heads
from magicdec.drafters.head_draft import FeatureTap, Sampler
from magicdec.drafters.hydra import HydraDraft


pytestmark = pytest.mark.usefixtures("inference_mode")  # conftest: no autograd in these tests


def hydra_head(model, num_heads=4, seed=0):
    head = heads.new_head("hydra", model.args, num_heads=num_heads, target=model, seed=seed)
    for k in range(num_heads):  # the hidden state through, the embeddings a little: head k repeats, nudged
        rc = head.hydra_mlp[k][0].res_connection.weight
        rc.zero_()
        rc[:, :model.args.dim].copy_(torch.eye(model.args.dim))
        rc[:, model.args.dim:].normal_(0, 0.05, generator=torch.Generator().manual_seed(seed + k))
    return head


@pytest.mark.parametrize("gamma", [1, 3])
def test_hydra_chain_equals_plain_greedy(tiny, gamma):
    check_greedy(tiny, hydra_head(tiny), tiny_prompts(), 50, gamma)


def test_hydra_trees_equal_plain_greedy(tiny):
    expected = plain_greedy(tiny, tiny_prompts(), 50)
    check_greedy(tiny, hydra_head(tiny), tiny_prompts(), 50, 3, expected, shape=shaped())
    check_greedy(tiny, hydra_head(tiny), tiny_prompts(), 50, 3, expected, width=2)


def test_hydra_sampled_keeps_the_targets_distribution(tiny, monkeypatch):
    check_sampled(tiny, hydra_head(tiny), monkeypatch)


def test_hydra_chain_is_each_head_given_the_path(tiny):
    head = heads.new_head("hydra", tiny.args, num_heads=3, seed=1)
    for p in head.parameters():
        p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    sd, emb = head.state_dict(), tiny.tok_embeddings.weight
    f = torch.randn(2, tiny.args.dim, generator=torch.Generator().manual_seed(0))
    tap = FeatureTap((4,), 2, 4, tiny.args.dim, torch.float32, "cpu")
    tap.start(f, torch.full((2,), 9))
    hist = torch.tensor([[5, 11], [6, 12]])
    tokens, _ = HydraDraft(head, tap, emb, Sampler(True)).propose(None, hist, torch.tensor([2, 2]),
                                                                  torch.full((2,), 9), 3)
    x = torch.cat([f, emb[hist[:, 1]]], -1)
    for k in range(3):
        pre = f"hydra_mlp.{k}.0."
        h = x @ sd[pre + "res_connection.weight"].T + sd[pre + "res_connection.bias"] + \
            F.silu(x @ sd[pre + "linear.weight"].T + sd[pre + "linear.bias"])
        tok = (h @ sd[f"hydra_lm_head.{k}.weight"].T + sd[f"hydra_lm_head.{k}.bias"]).argmax(-1)
        assert torch.equal(tokens[:, k], tok), k
        x = torch.cat([x, emb[tok]], -1)


def test_smollm2_hydra_equals_plain_greedy(smol_model, smol_prompts, smol_heads):
    from test_medusa import check_smollm2

    check_smollm2(smol_model, smol_heads("hydra"), smol_prompts, 20)
