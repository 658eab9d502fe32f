"""The engine (magicdec/harness/engine.py): what it checks against the models' configs before anything large is read or
allocated — a repo id that contradicts the checkpoint, a checkpoint whose tensors are not its config's, the memory of
the target and of each drafter — and that it is where caches and drafters come from."""
from __future__ import annotations

import shutil

import pytest
import torch

from magicdec import drafters
from magicdec.harness.engine import Engine, ModelRef, resolve_model
from magicdec.errors import MagicDecError
from magicdec.harness.run_config import RunConfig


def copy_checkpoint(tiny_hf, d):
    _, path = tiny_hf("llama", vocab_size=32000)
    shutil.copytree(path.parent, d)
    return d / "model.pth"


def test_a_model_name_must_agree_with_the_checkpoint(tiny_hf, tmp_path):
    path = copy_checkpoint(tiny_hf, tmp_path / "ckpt")
    with pytest.raises(MagicDecError, match="--model_name JackFram/llama-68m contradicts the checkpoint's config.json"):
        resolve_model(ModelRef(path, "JackFram/llama-68m", "--model"), False)  # a known model of other shapes
    with pytest.raises(MagicDecError, match="which names"):
        resolve_model(ModelRef(path, "acme/other-model", "--model"), False)
    config, _ = resolve_model(ModelRef(path, "ckpt", "--model"), False)  # the name the checkpoint gives itself
    assert config.dim == 64


def test_checkpoint_contents_are_checked_before_prompts_or_weights(tiny_hf, tmp_path, monkeypatch):
    path = copy_checkpoint(tiny_hf, tmp_path / "ckpt")
    state = torch.load(path, weights_only=True)
    del state["layers.1.feed_forward.w2.weight"]
    torch.save(state, path)
    monkeypatch.setattr(Engine, "prompts", lambda *a: pytest.fail("prompts loaded before the checkpoint was checked"))
    with pytest.raises(MagicDecError, match="--model: missing tensor layers.1.feed_forward.w2.weight"):
        Engine(RunConfig.from_options({"model": str(path), "device": "cpu"}))


@pytest.mark.parametrize("name", drafters.names())
def test_every_drafter_declares_its_memory(name, tmp_path):
    """The target's cache plus what the drafter adds: a model draft's cache slots (and a standalone draft's
    weights), none for prompt lookup, REST, SuffixDecoding (its tries are host memory) and Lookahead (its n-gram pool:
    kilobytes per sequence), Token Recycling's matrix, a Medusa or Hydra head's weights only, an EAGLE head's weights
    and its own KV; the cache holds the prompt and what a verification reaches past gen_len."""
    from magicdec import options as opt
    store = tmp_path / "store.npz"
    store.write_bytes(b"")  # REST's check wants the file; planning does not read it
    options = {"drafter": name, "random_weights": True, "model_name": "JackFram/llama-68m", "prefix_len": 512,
               "gen_len": 16, "device": "cpu", "draft_name": "JackFram/llama-68m"} | drafters.get(name).example
    if "datastore" in opt.keys(drafters.get(name).Config):
        options["datastore"] = str(store)
    cfg = RunConfig.from_options(options, strict=False)  # draft_name: for the drafters that take a draft model
    models, parts = Engine(cfg).plan(cfg)
    assert parts[0].weights and parts[0].slots == 512 + 16 + cfg.lookahead + 2
    extra = parts[1:]
    if name in ("lookup", "rest", "suffix", "lookahead"):
        assert not extra
    elif name in ("medusa", "hydra"):  # a head's weights over the target's hidden state, no KV of its own
        assert extra and all(p.slots == 0 and p.extra_bytes > 0 for p in extra)
    elif name == "recycling":  # its matrix of candidate ids: bytes, no weights, no KV
        assert [(p.weights, p.slots) for p in extra] == [(False, 0)] and extra[0].extra_bytes > 8 * 32000
    else:
        assert extra and all(0 < p.slots < 512 + 64 for p in extra)
    assert any(p.weights for p in extra) == (name in ("standalone", "hierarchy"))  # a draft model (a bottom one)


def test_a_drafter_model_that_does_not_fit_the_target_is_refused(tmp_path):
    cfg = RunConfig.from_options({"drafter": "standalone", "random_weights": True, "device": "cpu",
                                  "model_name": "meta-llama/Meta-Llama-3.1-8B", "draft_name": "TinyLlama/TinyLlama_v1.1"})
    with pytest.raises(MagicDecError, match=r"draft vocabulary \(32000\) differs from the target's \(128256\)"):
        Engine(cfg).plan(cfg)
