"""REST (retrieval-based speculative decoding): no draft model. Each sequence's longest recent suffix that occurs in
a datastore of other text (magicdec/drafters/datastore.py: a suffix array over tokenized books, the prompts' own books left
out) is looked up, and the continuations that followed it there, most frequent first, are proposed: with
--tree_width K the K most frequent as a token tree's branches (REST's trie, flattened into branches: a shared
prefix repeats across branches), else the most frequent as a chain.

Proposals are deterministic candidates, so greedy and sampled verification are lossless as for prompt lookup (a
one-hot q; a tree's siblings by the multi-candidate rule). The lookup runs on the host, per sequence, after one read
of the committed tokens per verification: REST's own datastore is a Rust library, this one numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from magicdec.drafters.datastore import DEPTH, Datastore
from magicdec.drafters.base import DrafterKind
from magicdec.errors import MagicDecError
from magicdec.decoding.generate import Drafter
from magicdec.options import option
from magicdec.model.tree import Tree


class RestDraft(Drafter):
    """Continuations from the datastore after each sequence's prompt and committed tokens."""

    def __init__(self, store: Datastore, prompts: torch.Tensor, max_suffix: int, vocab_size: int | None):
        self.store, self.prompts, self.max_suffix, self.vocab_size = store, prompts.cpu(), max_suffix, vocab_size
        self.found = self.looked_up = 0

    def begin(self) -> None:
        self.found = self.looked_up = 0

    def tree_for(self, tokens: int):
        return None if self.width == 1 else Tree.branches(tokens // self.width, self.width)

    def propose(self, step, hist: torch.Tensor, m: torch.Tensor, start: torch.Tensor, gamma: int):
        """width branches of gamma tokens per sequence ([B, width * gamma] in node order); where the datastore has
        fewer, the most frequent again; where it has none, the last token repeated (rejected unless right)."""
        B, P = self.prompts.shape
        rows = hist.cpu().tolist()
        counts = m.cpu().tolist()
        out = []
        for b in range(B):
            context = self.prompts[b, :P - 1].tolist()[-DEPTH:] + rows[b][:counts[b]]
            found = self.store.continuations(context, gamma, self.width, self.max_suffix)
            self.looked_up += 1
            self.found += bool(found)
            found = found or [[context[-1]] * gamma]
            out.append([t for j in range(self.width) for t in found[min(j, len(found) - 1)]])
        tokens = torch.tensor(out, dtype=torch.long, device=hist.device)
        q = None if self.vocab_size is None or self.width > 1 else F.one_hot(tokens, self.vocab_size).float()
        return tokens, q

    def summary(self) -> dict:
        return {"lookups": self.looked_up, "found": self.found}


@dataclass(frozen=True)
class Config:
    datastore: str | None = option(None, "REST's datastore (magicdec datastore --books DIR --tokenizer DIR "
                                         "--exclude PROMPT_BOOKS --output FILE)")
    max_suffix: int = option(DEPTH, f"the longest recent suffix looked up (1..{DEPTH})")


class Rest(DrafterKind):
    name = "rest"
    description = ("REST: no draft model; the continuations that followed the longest recent suffix in a datastore "
                   "of other text (--datastore), the most frequent first")
    Config = Config
    supports_auto_gamma = False
    supports_trees = True

    def label(self, draft) -> str:
        return f"{self.name} s{draft.max_suffix}"

    def describe(self, cfg) -> str:
        return f"none: retrieval from {cfg.draft.datastore} (suffixes up to {cfg.draft.max_suffix} tokens)"

    def check(self, cfg) -> None:
        super().check(cfg)
        d = cfg.draft
        if d.datastore is None:
            raise MagicDecError("--drafter rest needs --datastore FILE: build one with `magicdec datastore --books DIR "
                                "--tokenizer DIR --exclude PROMPT_BOOKS --output FILE`")
        if not Path(d.datastore).is_file():
            raise MagicDecError(f"--datastore {d.datastore}: no such file; build one with `magicdec datastore`")
        if not 1 <= d.max_suffix <= DEPTH:
            raise MagicDecError(f"--max_suffix {d.max_suffix}: must be 1..{DEPTH} (the datastore sorts suffixes "
                                f"by their first {DEPTH} tokens)")

    def prepare(self, cfg, ctx) -> RestDraft:
        store = Datastore.load(Path(cfg.draft.datastore), ctx.tokenizer)
        if store.meta["vocab_size"] > ctx.target.args.vocab_size:
            raise MagicDecError(f"--datastore {cfg.draft.datastore} holds ids of a {store.meta['vocab_size']}-token "
                                f"vocabulary; the target has {ctx.target.args.vocab_size}: rebuild it with the "
                                "target's tokenizer")
        ctx.notes["datastore"] = store.meta
        return RestDraft(store, ctx.prompts, cfg.draft.max_suffix,
                         None if cfg.decoding.greedy else ctx.target.args.vocab_size)


DRAFTER = Rest()
