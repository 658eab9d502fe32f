"""`magicdec recycle-matrix` (magicdec/harness/recycle_matrix.py): the matrix against a hand-written pass of
transformers' Llama (each position's top-k into its token's row, the latest position winning); the windows taken
from the books in turn; the command over stories260K (real weights and tokenizer) writing a file the drafter loads,
and files it refuses in one line."""
from __future__ import annotations

import json

import pytest
import torch

import test_train_head
from magicdec.drafters import recycling
from magicdec.errors import MagicDecError
from magicdec.harness import recycle_matrix

stories = test_train_head.stories  # stories260K converted (real weights and tokenizer)


def test_the_hot_start_matrix_holds_each_tokens_top_k_at_its_latest_position_as_transformers_ranks_them(tiny_hf):
    """build_matrix against a hand-written pass: transformers' Llama over each window in order, each position's k
    likeliest next ids written into its token's row, a later position overwriting an earlier one."""
    from magicdec.model.transformer import load_model

    hf, path = tiny_hf("llama", seed=5, num_hidden_layers=2, max_position_embeddings=512)
    model = load_model(path, "cpu", torch.float32)
    V, k = model.args.vocab_size, 3
    g = torch.Generator().manual_seed(4)
    windows = torch.randint(0, 12, (5, 9), generator=g)  # few distinct tokens: rows rewritten many times
    got = recycle_matrix.build_matrix(model, windows, k, batch=2)
    want = {}
    for w in windows:
        top = hf(w[None]).logits[0, :, :V].topk(k, -1).indices
        for t, row in zip(w.tolist(), top.tolist()):
            want[t] = row
    assert got.shape == (V + 1, k)
    for t in range(V):  # row V is the sink the duplicates of one pass write into
        assert got[t].tolist() == want.get(t, [0] * k), t


def test_recycle_matrix_writes_a_file_the_drafter_loads_and_refuses_others(stories, tmp_path, capsys):
    """The command over stories260K (real weights and tokenizer): the books but the excluded one, the tokens asked
    for, a file the drafter loads; a file for another vocabulary, too narrow, or not a matrix, one line."""
    from magicdec.cli import main as cli_main
    from magicdec.harness.run_config import RunConfig

    books = tmp_path / "books"
    books.mkdir()
    for name in ("a", "b", "prompts"):
        (books / f"{name}.txt").write_text(f"Book {name}. " + "The cat sat on the mat and looked out. " * 40)
    out = tmp_path / "warm.pt"
    assert cli_main(["recycle-matrix", "--books", str(books), "--exclude", "prompts", "--target", str(stories),
                     "--tokens", "200", "--seq_len", "50", "--k", "4", "--device", "cpu", "--no_progress", "--output", str(out)]) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said["books"] == ["a.txt", "b.txt"] and said["tokens"] == 4 * 50 and said["k"] == 4
    V = said["vocab_size"]
    matrix, record = recycling.load_matrix(out, V, 4)
    assert matrix.shape == (V + 1, 4) and record["target"]["path"] == str(stories / "model.pth")
    assert int((matrix[:V] != 0).any(1).sum()) > 5  # rows of the tokens read were written
    with pytest.raises(MagicDecError, match="keeps 4 candidates per token, --recycle_k is 5"):
        recycling.load_matrix(out, V, 5)
    with pytest.raises(MagicDecError, match=f"holds a {V}-token vocabulary, the target {V + 1}"):
        recycling.load_matrix(out, V + 1, 4)
    (tmp_path / "junk.pt").write_bytes(b"not a tensor file")
    with pytest.raises(MagicDecError, match="not a matrix from magicdec recycle-matrix"):
        recycling.load_matrix(tmp_path / "junk.pt", V, 4)
    with pytest.raises(MagicDecError, match="--recycle_matrix .*nowhere.pt: no such file"):
        RunConfig.from_options({"drafter": "recycling", "recycle_matrix": str(tmp_path / "nowhere.pt")}).check()


def test_the_windows_take_every_book_in_turn():
    docs = [torch.arange(100, 107), torch.arange(200, 204), torch.arange(300, 310)]
    w = recycle_matrix.windows_of(docs, 4, 14, bos=1)  # chunks of 3: a0 b0 c0 a1 c1 c2 ..., ceil(14 / 4) = 4 windows
    assert w.tolist() == [[1, 100, 101, 102], [1, 200, 201, 202], [1, 300, 301, 302], [1, 103, 104, 105]]
    with pytest.raises(MagicDecError, match="--seq_len 9: no book holds 8 tokens"):
        recycle_matrix.windows_of([torch.arange(5)], 9, 10, bos=1)


@pytest.mark.parametrize("flag, value", [("--tokens", "0"), ("--k", "0"), ("--seq_len", "1"), ("--batch", "0")])
def test_a_number_out_of_its_range_is_one_line_first(flag, value, tmp_path, capsys):
    """Checked before the books or the target are read (both are missing here)."""
    from magicdec.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["recycle-matrix", "--books", str(tmp_path / "none"), "--output", str(tmp_path / "m.pt"), flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {value}: must be an integer >=" in err[0], err
