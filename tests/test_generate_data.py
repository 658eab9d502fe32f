"""`magicdec generate-data` (magicdec/harness/generate_data.py) on the CPU with stories260K (real weights) over books of
its own stories: the same command gives the same shards byte for byte, a deleted shard comes back the same, changed
settings are refused; the contexts never come from held-out books (the split computed here from data.load_prompts);
at a nucleus that keeps one token the continuations are a plain argmax loop's over the same contexts; bad input is
one line before the target loads; train-head --data generated refuses data from books it holds out."""
from __future__ import annotations

import errno

import pytest
import torch

from magicdec.cli import main as cli_main
from magicdec.harness import generate_data, train_head
import test_train_head
from test_train_head import BIN, TOK, forbid_target_load, one_line

# train-head's fixtures: stories260K converted, and books of its own stories (stories0 held out by --exclude)
stories, corpus, one_thread = test_train_head.stories, test_train_head.corpus, test_train_head.one_thread

pytestmark = pytest.mark.skipif(not BIN.is_file() or not TOK.is_file(), reason="no stories260K fixture")

SMALL = ["--gen_len", "12", "--context_lens", "24", "40", "--batch", "3", "--holdout_B", "0", "--exclude", "stories0",
         "--device", "cpu", "--no_progress"]


def command(stories, corpus, out, *extra) -> list[str]:
    return ["--target", str(stories), "--corpus", str(corpus), "--out", str(out), "--tokens", "80", *SMALL, *extra]


def shard_bytes(out) -> dict:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard_*.pt"))}


def sequences(out) -> list[tuple]:
    """(book, start, context length, generated ids, ended at EOS) of every sequence in the folder."""
    rows = []
    for path in sorted(out.glob("shard_*.pt")):
        s = generate_data.read_shard(path)
        for b, st, ids, n, eos in zip(s["books"], s["starts"].tolist(), s["ids"], s["lengths"].tolist(), s["eos"]):
            rows.append((b, st, s["context_len"], ids[:n].tolist(), bool(eos)))
    return rows


def test_the_same_command_gives_the_same_shards_a_deleted_one_comes_back_and_changes_are_refused(
        stories, corpus, tmp_path, capsys):
    a = generate_data.generate(command(stories, corpus, tmp_path / "a"))
    generate_data.generate(command(stories, corpus, tmp_path / "b"))
    first = shard_bytes(tmp_path / "a")
    assert len(first) == a["generated"]["shards"] >= 3  # 80 tokens at most 36 a shard
    assert a["generated"]["tokens"] >= 80
    assert first == shard_bytes(tmp_path / "b")
    rows = sequences(tmp_path / "a")
    assert {n for _, _, n, _, _ in rows} == {24, 40}  # shard i takes context_lens[i % 2]
    assert len({(b, s) for b, s, _, _, _ in rows}) > 1  # contexts at several depths
    (tmp_path / "a" / "shard_00001.pt").unlink()
    again = generate_data.generate(command(stories, corpus, tmp_path / "a"))
    assert again["generated"]["written_now"] == 1
    assert shard_bytes(tmp_path / "a") == first
    # another seed: other shards; raising --tokens adds shards and keeps those written
    generate_data.generate(command(stories, corpus, tmp_path / "c", "--seed", "1"))
    assert shard_bytes(tmp_path / "c") != first
    more = generate_data.generate(command(stories, corpus, tmp_path / "a")[:-len(SMALL) - 1] + ["160", *SMALL])
    assert more["generated"]["shards"] > len(first) and more["generated"]["written_now"] > 0
    assert {k: v for k, v in shard_bytes(tmp_path / "a").items() if k in first} == first
    line = one_line_gen(capsys, command(stories, corpus, tmp_path / "a", "--temperature", "0.9"))
    assert line == (f"error: --out {tmp_path / 'a'} holds data generated with --temperature 0.6, not 0.9: give "
                    "--temperature 0.6 to continue it, or choose another --out")
    line = one_line_gen(capsys, command(stories, corpus, tmp_path / "a", "--context_lens", "24"))
    assert "holds data generated with --context_lens [24, 40], not [24]" in line


def one_line_gen(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(["generate-data", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_contexts_come_only_from_training_books_and_are_their_tokens(stories, corpus, tmp_path):
    """The held-out books worked out here from data.load_prompts (as the benchmarks cut prompts) plus --exclude:
    no context comes from one; each context's start leaves room for its tokens in its book."""
    from magicdec.data import PromptSource, load_prompts
    from magicdec.model.tokenizer import load_tokenizer

    tok = load_tokenizer(stories)
    src = PromptSource("folder", str(corpus))
    load_prompts(tok, 4, 60, src, 0, tok.bos_id, progress=False)
    held = {name for name, _ in src.used} | {"stories3.txt"}
    assert held != {"stories3.txt"} and len(held) < 4
    out = tmp_path / "out"
    generate_data.generate(["--target", str(stories), "--corpus", str(corpus), "--out", str(out), "--tokens", "150",
                            "--gen_len", "8", "--context_lens", "16", "--batch", "4", "--holdout_B", "4",
                            "--holdout_prefix_len", "60", "--skip_tokens", "0", "--exclude", "stories3", "--device",
                            "cpu", "--no_progress"])
    rows = sequences(out)
    books = {b for b, _, _, _, _ in rows}
    assert books and not books & held
    assert books == {f"stories{i}.txt" for i in range(4)} - held  # every training book is drawn from
    ids = {b: train_head.encode(tok, (corpus / b).read_text()) for b in books}
    assert all(0 <= s and s + n - 1 <= len(ids[b]) for b, s, n, _, _ in rows)
    manifest = generate_data.read_manifest(out)
    assert set(manifest["corpus"]["books"]) == books and set(manifest["corpus"]["held_out_books"]) <= held


def test_a_one_token_nucleus_continues_the_context_as_a_plain_argmax_loop(stories, corpus, tmp_path):
    """top_p 1e-9 keeps only each step's likeliest token: the shards must hold what an argmax loop over the full
    sequence (a fresh forward per token) writes after each context, stopping at EOS as it does."""
    from magicdec.model.kv_cache import KVCache
    from magicdec.model.tokenizer import load_tokenizer
    from magicdec.model.transformer import load_model

    out = tmp_path / "out"
    generate_data.generate(command(stories, corpus, out, "--top_p", "1e-9", "--gen_len", "20"))
    model, tok = load_model(stories / "model.pth", "cpu", torch.float32), load_tokenizer(stories)
    a = model.args
    rows = sequences(out)
    books = {b: train_head.encode(tok, (corpus / b).read_text()) for b, _, _, _, _ in rows}
    for book, start, n, generated, eos in rows:
        seq = [tok.bos_id] + books[book][start:start + n - 1]
        want, stopped = [], False
        with torch.inference_mode():
            while len(want) < 20:
                cache = KVCache(a.n_layers, 1, a.n_kv_heads, len(seq), a.head_dim, torch.float32, "cpu")
                nxt = int(model(torch.tensor([seq]), cache)[0, -1].argmax())
                if nxt in a.eos_ids:
                    stopped = True
                    break
                want.append(nxt)
                seq.append(nxt)
        assert (generated, eos) == (want, stopped), (book, start, n)


def test_train_head_refuses_data_from_a_book_it_holds_out(stories, corpus, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    generate_data.generate(command(stories, corpus, data))
    used = sorted({b for b, _, _, _, _ in sequences(data)})
    forbid_target_load(monkeypatch)
    line = one_line(capsys, ["--family", "eagle", "--data", "generated", str(data), "--out", str(tmp_path / "head"),
                             "--holdout_B", "0", "--exclude", "stories0", used[0].removesuffix(".txt"), "--seq_len",
                             "20", "--device", "cpu", "--no_progress"])
    assert f"its contexts come from {used[0]}, which this run holds out" in line, line
    line = one_line(capsys, ["--family", "eagle", "--data", "generated", str(tmp_path / "none"), "--out",
                             str(tmp_path / "head")])
    assert "no such folder; make it with magicdec generate-data" in line
    line = one_line(capsys, ["--family", "eagle", "--data", "made", "--out", str(tmp_path / "head")])
    assert line == ("error: --data made: give --data corpus (the books' text) or --data generated DIR (a magicdec "
                    "generate-data folder)")


@pytest.mark.parametrize("flags, expected", [
    (["--tokens", "0"], "--tokens 0: must be an integer >= 1"),
    (["--temperature", "0"], "--temperature 0.0: must be a finite number > 0"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number > 0"),
    (["--top_p", "0"], "--top_p 0.0: must be in (0, 1]"),
    (["--batch", "0"], "--batch 0: must be an integer >= 1"),
    (["--gen_len", "-1"], "--gen_len -1: must be an integer >= 1"),
    (["--context_lens", "1", "8"], "--context_lens 1: each must be an integer >= 2"),
    (["--context_lens", "400"], "--context_lens 400 + --gen_len 200 = 600 exceeds the target's context of 512 "
                                "tokens; lower the longest --context_lens or --gen_len"),
    (["--context_lens", "24", "300"], "--context_lens 300: no training book holds 299 tokens"),
    (["--context_lens", "300"], "no book is left to train on with windows of 300 tokens"),
    (["--shard", "3/2"], "--shard 3/2: give I/N with 1 <= I <= N"),
])
def test_bad_input_is_one_line_before_the_target_loads(flags, expected, stories, tmp_path, capsys, monkeypatch):
    c = tmp_path / "corpus"
    c.mkdir()
    (c / "a.txt").write_text("Once upon a time there was a little dog. " * 20)  # about 230 tokens
    (c / "b.txt").write_text("The cat sat. " * 10)
    forbid_target_load(monkeypatch)
    argv = ["--target", str(stories), "--corpus", str(c), "--out", str(tmp_path / "out"), "--tokens", "10",
            "--gen_len", "200", "--holdout_B", "0", "--device", "cpu", "--no_progress", *flags]
    if "--context_lens" not in flags:
        argv += ["--context_lens", "24"]
    line = one_line_gen(capsys, argv)
    assert expected in line, line


def test_an_out_that_cannot_be_written_is_one_line_first(stories, corpus, tmp_path, capsys, monkeypatch):
    from test_files import faulty_disk

    forbid_target_load(monkeypatch)
    (tmp_path / "file").write_text("x")
    line = one_line_gen(capsys, command(stories, corpus, tmp_path / "file"))
    assert line == f"error: --out {tmp_path / 'file'} is a file: give the folder the shards and their manifest go to"
    faulty_disk(monkeypatch, tmp_path / "ro", errno.EROFS)
    line = one_line_gen(capsys, command(stories, corpus, tmp_path / "ro"))
    assert line == (f"error: --out: cannot write to {tmp_path / 'ro'} (the file system is read-only); choose a folder "
                    "on a writable disk")


def test_an_interrupted_run_leaves_whole_shards_and_the_rest_come_back_the_same(stories, corpus, tmp_path,
                                                                                  monkeypatch):
    """Ctrl-C while shard 2 is being written: shards 0 and 1 stand whole, no temporary is left, and the same command
    then writes shards equal to an uninterrupted run's."""
    from test_files import temporaries

    generate_data.generate(command(stories, corpus, tmp_path / "straight"))
    save = generate_data.files.save_torch

    def interrupt_third(path, obj, what=""):
        if path.name == generate_data.shard_name(2):
            raise KeyboardInterrupt
        return save(path, obj, what)

    monkeypatch.setattr(generate_data.files, "save_torch", interrupt_third)
    with pytest.raises(KeyboardInterrupt, match="the 2 shards in .* are whole"):
        generate_data.generate(command(stories, corpus, tmp_path / "cut"))
    assert sorted(shard_bytes(tmp_path / "cut")) == ["shard_00000.pt", "shard_00001.pt"]
    assert temporaries(tmp_path / "cut") == []
    monkeypatch.setattr(generate_data.files, "save_torch", save)
    generate_data.generate(command(stories, corpus, tmp_path / "cut"))
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "straight")


def test_shards_written_by_slices_are_the_single_process_shards_and_the_plain_pass_completes_them(
        stories, corpus, tmp_path):
    whole = generate_data.generate(command(stories, corpus, tmp_path / "one"))
    planned = generate_data.planned_shards(generate_data.Options(gen_len=12, batch=3), 80)  # 80 / 36: 3
    for part in ("2/2", "1/2"):
        got = generate_data.generate(command(stories, corpus, tmp_path / "two", "--shard", part))
        assert got["generated"]["shard"] == part
    sliced = shard_bytes(tmp_path / "two")
    assert sorted(sliced) == [generate_data.shard_name(i) for i in range(planned)]
    ours = shard_bytes(tmp_path / "one")
    assert all(ours[name] == data for name, data in sliced.items())
    done = generate_data.generate(command(stories, corpus, tmp_path / "two"))
    assert done["generated"]["written_now"] == len(ours) - planned  # what EOS left short, and no more
    assert shard_bytes(tmp_path / "two") == ours
    assert {k: done["generated"][k] for k in ("shards", "tokens")} == {k: whole["generated"][k]
                                                                       for k in ("shards", "tokens")}
