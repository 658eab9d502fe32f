"""tests/{selfspec,longspec}_benchmark.py (magicdec/runs.py) end to end on CPU, in process: the record's fields, and
greedy speculation giving exactly the baseline script's ids on the same prompts (lossless end to end), on tiny random
checkpoints and on SmolLM2; sampled and synthetic-acceptance runs; and bad input as subprocesses (exit 2, one
`error:` line that names the problem and the fix)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import BOOKS, STORIES, needs_smollm2, one_line_error, run_cli, run_here
from magicdec import drafters, files, options
from magicdec.cli import run_record

REPO = Path(__file__).resolve().parents[1]
GUTENBERG = BOOKS
SCRIPTS = {m: REPO / "tests" / f"{m}_benchmark.py" for m in ("baseline", "selfspec", "longspec", "lookup")}

import baseline_benchmark
import longspec_benchmark
import lookup_benchmark
import selfspec_benchmark
import triforce_benchmark

GAMMA = 3
B, PREFIX, GEN = 3, 64, 40
LLAMA68M = ("--random_weights", "--model_name", "JackFram/llama-68m")
SMALL_RANDOM = ("--random_weights", "--model_name", "test/small-random")


@pytest.fixture
def small_random(monkeypatch):
    """A known model name for random-weight runs whose checks do not depend on the model's size (synthetic
    acceptance, a replayed trace): 3 layers of 96, 512 tokens, other shapes than the tiny checkpoints'. llama-68m's
    32000-word LM head was most of these runs' time."""
    from magicdec.config import KNOWN_MODELS, ModelArgs

    monkeypatch.setitem(KNOWN_MODELS, "test/small-random", ModelArgs(
        vocab_size=512, dim=96, n_layers=3, n_heads=6, n_kv_heads=2, intermediate_size=160, max_seq_len=1024,
        bos_id=1, eos_id=2))

# ------------------------------------------------------------------ tiny checkpoints with a 256-token tokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny configs' bos_token_id 1 and eos_token_id 2
# one token per character: printable ASCII, newline, then Latin-1 and beyond (so the tokenizer probe's "naïve café"
# has real tokens too); 253 pieces + 3 specials = the tiny models' 256-token vocabulary
PIECES = ([chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(161, 1000) if c != 173])[:253]
WORDS = [f"w{i}" for i in range(253)]  # a word-level vocabulary that has none of the probe's words


def write_tokenizer(d: Path, pieces: list[str], per_char: bool = True) -> None:
    """A `tokenizers` WordLevel tokenizer.json over SPECIALS + pieces (ids in that order)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(SPECIALS + pieces)}, unk_token="<unk>"))
    if per_char:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))


def save_checkpoint(d: Path, cfg: dict, sd: dict, n_layers: int | None = None) -> Path:
    """config.json + model.pth in d; n_layers keeps only the first layers (a draft sharing the target's embedding,
    final norm and head)."""
    d.mkdir(parents=True)
    if n_layers is not None:
        cfg = cfg | {"num_hidden_layers": n_layers}
        sd = {k: v for k, v in sd.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save(sd, d / "model.pth")
    return d / "model.pth"


@pytest.fixture(scope="module")
def tiny(tiny_hf, tmp_path_factory):
    """Model paths: `target` (2 layers); `draft` (its first layer) and `twin` (a copy of the target) with the target's
    tokenizer files copied beside them; `permuted` (the draft's weights, a tokenizer mapping the same 256 strings to
    other ids); and a word-level pair `word_target` / `word_permuted` (same 253 words, different ids).

    The target is tiny_hf's random Llama with its attention outputs scaled by 0.3 and its second layer's
    contributions by 0.3 more, so that a StreamingLLM draft (or the first layer alone) agrees with it on roughly
    a third of the tokens: greedy runs then accept different numbers of tokens per sequence and verification, and
    lossless output is a real check, not the trivial one of a draft that is always rejected."""
    _, src = tiny_hf("llama", seed=21)
    cfg = json.loads((src.parent / "config.json").read_text())
    sd = torch.load(src, weights_only=True)
    for k in sd:
        if k.endswith("attention.wo.weight"):
            sd[k] = sd[k] * 0.3
        if k.startswith("layers.1.") and k.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            sd[k] = sd[k] * 0.3
    root = tmp_path_factory.mktemp("runs")
    paths = {"target": save_checkpoint(root / "target", cfg, sd), "draft": save_checkpoint(root / "draft", cfg, sd, 1),
             "twin": save_checkpoint(root / "twin", cfg, sd),
             "short": save_checkpoint(root / "short", cfg | {"max_position_embeddings": 40}, sd, 1),
             "permuted": save_checkpoint(root / "permuted", cfg, sd, 1),
             "word_target": save_checkpoint(root / "word_target", cfg, sd),
             "word_permuted": save_checkpoint(root / "word_permuted", cfg, sd, 1)}
    write_tokenizer(root / "target", PIECES)
    for name in ("draft", "twin", "short"):  # the target's own tokenizer file, copied
        (root / name / "tokenizer.json").write_bytes((root / "target" / "tokenizer.json").read_bytes())
    write_tokenizer(root / "permuted", PIECES[::-1])
    write_tokenizer(root / "word_target", WORDS, per_char=False)
    write_tokenizer(root / "word_permuted", WORDS[::-1], per_char=False)
    return paths


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    """Three documents of real prose, restricted to the tiny tokenizer's characters."""
    allowed = set(PIECES)
    text = (GUTENBERG / "pg1342.txt").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    docs = ["".join(ch for ch in text[start:start + 1500] if ch in allowed) for start in (20_000, 40_000, 60_000)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def tiny_args(jsonl: Path, *extra: str) -> list[str]:
    return ["--dataset", str(jsonl), "--skip_tokens", "0", "--B", str(B), "--prefix_len", str(PREFIX),
            "--gen_len", str(GEN), "--device", "cpu", "--no_progress", "--save_tokens", *extra]


SPEC_ARGS = ("--streamingllm_budget", "24", "--sinks", "4", "--gamma", str(GAMMA))


@pytest.fixture(scope="module")
def tiny_baseline(tiny, jsonl, tmp_path_factory) -> dict:
    """The baseline script's record on the tiny target: the ids every greedy speculative run must reproduce."""
    out = tmp_path_factory.mktemp("baseline") / "b.json"
    return baseline_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), "--output", str(out)))


# ------------------------------------------------------------------ record checks

def check_spec_record(record: dict, method: str, B: int, gen_len: int, gamma: int, with_baseline: bool) -> dict:
    assert record["method"] == method
    m = record["metrics"]
    spec = m["speculation"]
    assert 0 <= m["alpha"] <= 1 and m["alpha"] == spec["alpha"]
    assert 1 <= m["omega"] <= gamma + 1 and m["omega"] == spec["omega"]
    assert m["omega"] == pytest.approx((spec["accepted_tokens"] + spec["verifications"]) / spec["verifications"])
    ppa = spec["per_position_acceptance"]
    assert len(ppa) == gamma and all(p is None or 0 <= p <= 1 for p in ppa)
    assert spec["gamma"] == gamma and m["iterations"] == spec["iterations"] > 0
    ids, counts = torch.tensor(record["generated_ids"]), torch.tensor(record["generated_counts"])
    assert ids.shape == (B, gen_len) and ((1 <= counts) & (counts <= gen_len)).all()
    assert m["generated_tokens"] == int(counts.sum())
    # every verification of an active sequence yields accepted + 1 tokens (less when it stops at EOS or gen_len)
    assert int((counts - 1).sum()) <= spec["accepted_tokens"] + spec["verifications"]
    if with_baseline:
        check_speedup(record, B)
        # the cost ratios, from the phases' measured seconds: a draft step over a baseline step (the baseline's
        # verify phase is its one step), a verification over a baseline step
        base = record["baseline_metrics"]
        t_t = base["time_split_s"]["verify"] / base["iterations"]
        t_d = m["time_split_s"]["draft"] / spec["draft_steps"] / t_t
        t_v = m["time_split_s"]["verify"] / spec["iterations"] / t_t
        assert m["T_D_over_T_T"] == pytest.approx(t_d, rel=1e-9) and m["T_V_over_T_T"] == pytest.approx(t_v, rel=1e-9)
        if spec["draft_steps"] == gamma * spec["iterations"]:  # Omega's closed form needs gamma drafts per verification
            a = m["alpha"]
            omega = gamma + 1 if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)
            assert m["predicted_speedup"] == pytest.approx(omega / (gamma * t_d + t_v), rel=1e-9)
        else:
            assert "predicted_speedup" not in m
    return m


def check_speedup(record: dict, B: int) -> None:
    """The measured speedup written out: the run and its baseline decode the same tokens (all but each sequence's
    first, which the prefill makes), so it is the baseline's decode seconds over the run's."""
    m, base = record["metrics"], record["baseline_metrics"]
    assert base["generated_tokens"] == m["generated_tokens"]
    assert m["decode_tokens_per_s"] == pytest.approx((m["generated_tokens"] - B) / m["decode_s"], rel=1e-9)
    assert m["measured_speedup"] == pytest.approx(base["decode_s"] / m["decode_s"], rel=1e-9)


def check_saved(record: dict, output: Path) -> None:
    saved = json.loads(output.read_text())
    assert saved["generated_ids"] == record["generated_ids"]
    assert saved["metrics"] == json.loads(json.dumps(record["metrics"]))


def assert_lossless(spec: dict, base: dict) -> None:
    assert spec["prompt_ids"] == base["prompt_ids"]
    assert spec["generated_ids"] == base["generated_ids"]
    assert spec["generated_counts"] == base["generated_counts"]


# ------------------------------------------------------------------ end to end, in process

def test_selfspec_tiny_end_to_end(tiny, jsonl, tiny_baseline, tmp_path):
    out = tmp_path / "s.json"
    record = selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), *SPEC_ARGS, "--baseline",
                                              "--output", str(out)))
    check_spec_record(record, "selfspec", B, GEN, GAMMA, with_baseline=True)
    check_saved(record, out)
    assert record["decoding"] == "greedy" and record["random_weights"] is False
    assert record["synthetic_acceptance"] is None and record["draft_models"] is None
    assert record["config"]["drafter"] == "selfspec" and len(record["config_hash"]) == 12
    assert set(record["environment"]["code"]) == {"commit", "dirty"}
    assert "tiny.jsonl" in record["prompt_source"]
    assert torch.tensor(record["prompt_ids"]).shape == (B, PREFIX)
    assert_lossless(record, tiny_baseline)
    assert 0.1 < record["metrics"]["alpha"] < 1  # some tokens accepted, some rejected


@pytest.fixture(scope="module")
def datastore(tiny, tiny_baseline, tmp_path_factory) -> Path:
    """A REST datastore in the tiny tokenizer: the baseline's own output for the first prompt (so that sequence's
    lookups are right, the others' mostly not) and noise."""
    from magicdec.drafters.datastore import Datastore
    from magicdec.model.tokenizer import load_tokenizer

    first = tiny_baseline["prompt_ids"][0][-8:] + tiny_baseline["generated_ids"][0]
    noise = torch.randint(3, 256, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    path = tmp_path_factory.mktemp("rest") / "store.npz"
    Datastore.build([first, noise], load_tokenizer(tiny["target"].parent), ["baseline", "noise"]).save(path)
    return path


def example_args(name: str, tiny, datastore: Path | None = None) -> list[str]:
    """A registered drafter's example options as flags, with the tiny 1-layer draft where it takes a draft model
    (and the tiny datastore where it takes one)."""
    kind = drafters.get(name)
    keys = options.keys(kind.Config)
    given = dict(kind.example) | ({"draft": str(tiny["draft"])} if "draft" in keys else {}) | (
        {"datastore": str(datastore)} if "datastore" in keys and datastore else {})
    return ["--drafter", name] + [x for k, v in given.items() for x in (f"--{k}", str(v))]


HEAD_FAMILIES = tuple(drafters.owners("head"))  # the drafters that draft with a trained head


@pytest.fixture(scope="module")
def tiny_heads(tiny, tiny_baseline, tmp_path_factory):
    """family -> the directory of a head trained for the tiny target by `magicdec train-head` (300 steps) on the
    target's own text: the baseline's prompts and greedy continuations of the first two prompts, decoded (the
    tokenizer is one token per character), the third held out. The runs below then keep many drafts on two
    sequences and few on the third (a ragged batch). A fresh head drafts the target's own last prediction again
    (how its training starts), which this target never keeps: the lossless check would be the trivial one."""
    from magicdec.harness import train_head
    from magicdec.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny["target"].parent)
    corpus = tmp_path_factory.mktemp("head_corpus")
    for i, (prompt, generated) in enumerate(zip(tiny_baseline["prompt_ids"], tiny_baseline["generated_ids"])):
        (corpus / f"seq{i}.txt").write_text(tokenizer.decode(prompt + generated))
    done = {}

    def get(family: str) -> Path:
        if family not in done:
            out = tmp_path_factory.mktemp(f"head_{family}")
            train_head.train(["--family", family, "--target", str(tiny["target"]), "--corpus", str(corpus), "--out",
                              str(out), "--batch_size", "4", "--seq_len", "40", "--lr", "1e-2", "--warmup", "3",
                              "--eval_windows", "2", "--holdout_B", "0", "--exclude", "seq2", "--device", "cpu",
                              "--no_progress", "--steps", "300", "--eval_every", "300", "--save_every", "300"])
            done[family] = out
        return done[family]

    return get


@pytest.mark.parametrize("name", drafters.names())
def test_every_registered_drafter_is_lossless(tiny, jsonl, tiny_baseline, datastore, tiny_heads, name):
    """Every drafter the registry finds, with its own example options (a trained head's with one trained here),
    through `magicdec run`: greedy speculation gives exactly the baseline script's ids, at least 5 drafted tokens
    kept and some not, its record names it; sampled, the same command gives the same tokens (seeded) and only
    tokens of the vocabulary."""
    head = ["--head", str(tiny_heads(name))] if name in HEAD_FAMILIES else []
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA),
                     *example_args(name, tiny, datastore), *head)
    record = run_record(argv)
    check_spec_record(record, name, B, GEN, GAMMA, with_baseline=False)
    assert_lossless(record, tiny_baseline)
    assert 0 < record["metrics"]["alpha"] < 1 and record["label"].startswith(name)
    # lossless over kept drafts, not one: 6 (Medusa) to 56 (the hierarchy) of about 80 examined, measured
    assert record["metrics"]["speculation"]["accepted_tokens"] >= 5, record["metrics"]["speculation"]["per_sequence"]
    sampled = run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])
    assert sampled["decoding"].startswith("sampled") and all(0 <= t < 256 for r in sampled["generated_ids"] for t in r)
    assert run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])["generated_ids"] == sampled["generated_ids"]


@pytest.mark.parametrize("name,fmt", [("selfspec", "int8"), ("selfspec", "fp8"), ("selfspec", "int4"),
                                      ("standalone", "int8"), ("hierarchy", "int4")])
def test_model_drafters_run_each_draft_weight_format_losslessly(tiny, jsonl, tiny_baseline, name, fmt):
    """A drafter's example with its draft's weights (the hierarchy's middle level) in each format gives the
    baseline's ids; the record names the format and the kernel each quantized layer ran (the reference, on a CPU)."""
    group = ["--draft_group", "32"] if fmt == "int4" else []  # 32 divides the tiny models' widths
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA), *example_args(name, tiny),
                     "--draft_weights", fmt, *group)
    record = run_record(argv)
    assert_lossless(record, tiny_baseline)
    assert record["config"]["draft_weights"] == fmt and f" {fmt}" in record["label"]
    layers = 1 if name == "standalone" else 2  # the 1-layer draft, or the target's own
    assert record["drafter_notes"]["draft_weights"]["kernels"][0]["layers_by_kernel"] == {"reference": 5 * layers + 1}


# the drafters that propose trees, but those with a trained head (test_head_draft.py trains and checks theirs)
@pytest.mark.parametrize("name", [n for n in drafters.having("supports_trees") if n not in HEAD_FAMILIES])
def test_drafters_proposing_trees_are_lossless(tiny, jsonl, tiny_baseline, datastore, name):
    """--tree_width 3 (a model draft: each drafted position with the draft's two next candidates beside it; lookup:
    three earlier occurrences as branches) gives the baseline's ids, greedy; sampled runs and stays seeded; the
    label says tree."""
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA),
                     *example_args(name, tiny, datastore), "--tree_width", "3")
    record = run_record(argv)
    assert_lossless(record, tiny_baseline)
    assert record["config"]["tree_width"] == 3 and record["label"].endswith("tree w3")
    assert 0 < record["metrics"]["alpha"] <= 1
    per_rank = record["metrics"]["speculation"]["per_rank"]
    assert len(per_rank["reached"]) == 3 and per_rank["reached"][0] >= per_rank["reached"][1] > 0
    sampled = run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])
    assert run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])["generated_ids"] == sampled["generated_ids"]


@pytest.mark.parametrize("name", [n for n in drafters.having("drafts_shaped_trees") if n not in HEAD_FAMILIES])
def test_drafted_sequoia_trees_are_lossless(tiny, jsonl, tiny_baseline, name):
    """--tree_nodes 12 --tree_rates ...: the draft drafts Sequoia's tree for that acceptance vector level by level;
    greedy gives the baseline's ids; sampled runs, stays seeded, and keeps more than one token per verification
    on average; the label says tree n12."""
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", "4", *example_args(name, tiny),
                     "--tree_nodes", "12", "--tree_rates", "0.7", "0.4", "0.3")
    record = run_record(argv)
    assert_lossless(record, tiny_baseline)
    assert record["config"]["tree_nodes"] == 12 and record["label"].endswith("tree n12")
    per_rank = record["metrics"]["speculation"]["per_rank"]
    assert len(per_rank["reached"]) >= 3 and per_rank["reached"][0] >= per_rank["reached"][1] > 0
    sampled = run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])
    assert run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])["generated_ids"] == sampled["generated_ids"]
    if name == "suffix":  # copies earlier text: what the tiny random model's sampled text lets it keep is chance (0
        # or 2 tokens in 39 verifications, by platform); tests/test_suffix.py checks its sampled acceptance against the
        # target's distribution. Here: the sampled run proposed and verified its trees, siblings included
        assert sampled["metrics"]["speculation"]["per_rank"]["reached"][1] > 0
    else:
        assert sampled["metrics"]["omega"] > 1


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_eagle_dynamic_trees_run_end_to_end(tiny, jsonl, tiny_baseline, family):
    """--dynamic_tree_nodes through `magicdec run` with a fresh head (the wiring: options, cache sizes, the
    drafter's tree per proposal; tests/test_dynamic_tree.py checks trained heads' trees): greedy gives the
    baseline's ids, sampled runs and stays seeded, the label says dynamic."""
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", "3", "--drafter", family,
                     "--dynamic_tree_nodes", "12", "--dynamic_tree_topk", "4")
    record = run_record(argv)
    assert_lossless(record, tiny_baseline)
    assert record["config"]["dynamic_tree_nodes"] == 12 and "dynamic 12 k4" in record["label"]
    sampled = run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])
    assert run_record(argv + ["--temperature", "0.6", "--top_p", "0.9"])["generated_ids"] == sampled["generated_ids"]


def test_synthetic_tree_acceptance_at_random_weights(small_random):
    """A random-weight tree run keeps each tree level's first candidate at --synthetic_acceptance and a later one at
    --synthetic_siblings once the earlier ones were not: the record's per-rank rates come back near them."""
    argv = [*SMALL_RANDOM, "--prefix_len", "64", "--B", "8", "--gen_len", "96", "--device", "cpu", "--drafter",
            "selfspec", "--draft_budget", "32", "--sinks", "4", "--gamma", "3", "--tree_width", "2",
            "--synthetic_acceptance", "0.8", "--synthetic_siblings", "0.5", "--ignore_eos", "--no_progress"]
    m = run_record(argv)["metrics"]
    rates = m["speculation"]["per_rank_acceptance"]
    assert abs(rates[0] - 0.8) < 0.08 and abs(rates[1] - 0.5) < 0.15, rates
    assert m["alpha"] > 0.8  # a level is kept more often than its first candidate alone


def test_a_saved_trace_is_replayed_at_random_weights(tiny, jsonl, tmp_path, small_random):
    """--save_trace puts a real run's kept counts per verification in its record; a random-weight run at another
    model's shape with --acceptance_trace that record keeps, sequence by sequence, exactly those counts at the same
    gamma (its own --save_trace shows it), and its alpha is the trace's."""
    real = run_record(tiny_args(jsonl, "--model", str(tiny["target"]), "--drafter", "selfspec", *SPEC_ARGS,
                                "--save_trace", "--ignore_eos",
                                "--output", str(tmp_path / "real.json")))
    trace = real["acceptance_trace"]
    assert len(trace["gammas"]) == len(trace["accepted"]) and set(trace["gammas"]) == {GAMMA}
    assert all(len(row) == B for row in trace["accepted"])
    replay = run_record([*SMALL_RANDOM, "--prefix_len", "64", "--B", str(B), "--gen_len", str(GEN), "--device", "cpu",
                         "--no_progress", "--drafter", "selfspec", "--draft_budget", "32", "--sinks", "4", "--gamma",
                         str(GAMMA), "--synthetic_acceptance", "0.5", "--acceptance_trace", str(tmp_path / "real.json"),
                         "--save_trace", "--ignore_eos"])
    assert replay["acceptance_trace"] == trace
    assert replay["metrics"]["alpha"] == pytest.approx(real["metrics"]["alpha"])


@pytest.mark.parametrize("flags,needle", [(("--acceptance_trace", "missing.json", "--synthetic_acceptance", "0.8"),
                                           "cannot read it"),
                                          (("--acceptance_trace", "EMPTY", "--synthetic_acceptance", "0.8"),
                                           "--save_trace"),
                                          (("--acceptance_trace", "EMPTY",), "give --synthetic_acceptance"),
                                          (("--synthetic_positions", "0.9", "0.5"), "give --synthetic_acceptance"),
                                          (("--synthetic_positions", "1.2", "--synthetic_acceptance", "0.8"),
                                           "in [0, 1]"),
                                          (("--synthetic_positions", "0.9", "--synthetic_acceptance", "0.8",
                                            "--tree_width", "2", "--synthetic_siblings", "0.5"), "a chain's acceptance")])
def test_bad_acceptance_structure_is_one_line(tmp_path, flags, needle):
    (tmp_path / "empty.json").write_text('{"config": {}}')
    flags = [str(tmp_path / "empty.json") if f == "EMPTY" else f for f in flags]
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", *flags), needle)


@pytest.mark.parametrize("flags,needle", [(("--drafter", "hierarchy", "--draft", "ngram", "--draft_budget", "32", "--tree_width", "2"),
                                           "drafts chains only"),
                                          (("--tree_width", "0"), "at least 1"),
                                          (("--gamma", "8", "--tree_width", "8"), "at most 64"),
                                          (("--tree_width", "2", "--synthetic_acceptance", "0.8"),
                                           "--synthetic_siblings"),
                                          (("--synthetic_siblings", "0.3"), "--synthetic_acceptance"),
                                          (("--tree_nodes", "65"), "2..64"),
                                          (("--tree_nodes", "12"), "give --tree_rates"),
                                          (("--tree_nodes", "12", "--tree_width", "2", "--tree_rates", "0.5"),
                                           "give one of them"),
                                          (("--tree_rates", "0.5"), "give --tree_nodes"),
                                          (("--tree_nodes", "12", "--tree_rates", "1.5"), "in [0, 1]"),
                                          (("--tree_nodes", "12", "--synthetic_acceptance", "0.8"),
                                           "--synthetic_siblings"),
                                          (("--drafter", "lookup", "--tree_nodes", "12", "--tree_rates", "0.5"),
                                           "level by level"),
                                          (("--tree_nodes", "12", "--tree_rates", "0.5", "--draft_kv", "int8"),
                                           "drafts chains only")])
def test_bad_tree_flags_are_one_line(flags, needle):
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", *flags), needle)


@pytest.mark.parametrize("name,kv", [("selfspec", "int4"), ("hierarchy", "int8")])
def test_self_drafts_over_a_quantized_copy_of_the_targets_kv_are_lossless(tiny, jsonl, tiny_baseline, name, kv):
    """--draft_kv (QuantSpec's draft; the hierarchy's middle level) gives the baseline's ids; the record says so."""
    extra = ["--draft", "ngram"] if name == "hierarchy" else []
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA), "--drafter", name, *extra,
                     "--draft_kv", kv)
    record = run_record(argv)
    assert_lossless(record, tiny_baseline)
    assert record["config"]["draft_kv"] == kv and f"kv {kv}" in record["label"]
    assert f"through a {kv.upper()} copy" in record["draft_cache"]


def test_first_done_and_all_reach_agree_at_batch_one(tiny, jsonl):
    """One clock: a speedup's seconds, all-reach and first-done alike, are spans of the loop's own wall clock from
    the same start as its baseline's. With one sequence the first to finish is the last, so the two speedups are
    the same number (they differed by a median 2.2% when first-done summed GPU-event spans)."""
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), *SPEC_ARGS, "--baseline", "--ignore_eos", "--repeats", "3")
    argv[argv.index("--B") + 1] = "1"
    m = selfspec_benchmark.run(argv)["metrics"]
    assert m["measured_speedup_first_done"] == pytest.approx(m["measured_speedup"], rel=1e-9)
    assert m["speculation"]["first_done"]["iterations"] == m["iterations"]
    assert m["speculation"]["first_done"]["seconds"] == pytest.approx(m["decode_s"], rel=1e-9)


@pytest.mark.parametrize("draft,budget", [("draft", "24"), ("draft", "0"), ("twin", "0")])  # 0: full draft cache
def test_longspec_tiny_end_to_end(tiny, jsonl, tiny_baseline, tmp_path, draft, budget):
    out = tmp_path / "l.json"
    record = longspec_benchmark.run(tiny_args(jsonl, "--target", str(tiny["target"]), "--model", str(tiny[draft]),
                                              "--streamingllm_budget", budget, "--sinks", "4", "--gamma", str(GAMMA),
                                              "--baseline", "--output", str(out)))
    m = check_spec_record(record, "standalone", B, GEN, GAMMA, with_baseline=True)
    check_saved(record, out)
    assert record["model_config"]["n_layers"] == 2
    assert record["draft_models"]["draft"]["n_layers"] == (1 if draft == "draft" else 2)
    assert record["config"]["draft_budget"] == int(budget) and record["config"]["model"] == str(tiny["target"])
    assert_lossless(record, tiny_baseline)
    if draft == "twin":  # the target itself with a full cache drafts exactly what the target would say
        assert m["alpha"] == 1.0 and m["speculation"]["per_position_acceptance"] == [1.0] * GAMMA
    else:
        assert 0.1 < m["alpha"] < 1  # some tokens accepted, some rejected


@pytest.mark.parametrize("bottom", ["ngram", "draft"])
def test_hierarchy_end_to_end(tiny, jsonl, tiny_baseline, bottom):
    """--hierarchy: the retrieval self-draft speculates with a bottom draft (prompt lookup, or the 1-layer draft
    checkpoint); lossless, each level's acceptance in the record, --refresh re-selecting the middle's cache."""
    drafted = "ngram" if bottom == "ngram" else str(tiny["draft"])
    record = selfspec_benchmark.run(tiny_args(
        jsonl, "--model", str(tiny["target"]), "--draft_policy", "retrieval", "--draft_budget", "48", "--gamma", "4",
        "--hierarchy", "--draft", drafted, "--gamma_bottom", "2", "--bottom_budget", "24", "--sinks", "4",
        "--refresh", "3"))
    check_spec_record(record, "hierarchy", B, GEN, 4, with_baseline=False)
    assert_lossless(record, tiny_baseline)
    levels = record["metrics"]["speculation"]["drafter"]
    assert levels["middle_verifications"] > 0 and record["draft_cache"].startswith("bottom: ")
    assert levels["refreshes"] > 0
    if bottom == "draft":
        assert 0 < levels["alpha_bottom_to_middle"] < 1


def test_triforce_command_line(tiny, jsonl, tiny_baseline):
    """TriForce's flags (--prefill, --budget, --chunk_size, --gamma, --temp, --top_p, --draft_cache_budget) run the
    hierarchy: greedy here (--temp 0), lossless; TriForce's defaults fill what is not given."""
    argv = ["--prefill", str(PREFIX), "--budget", "48", "--chunk_size", "4", "--gamma", "4", "--temp", "0",
            "--draft_cache_budget", "24", "--sinks", "4", "--gen_len", str(GEN)]
    args, _ = triforce_benchmark.translate(["--prefill=9", "--temp", "0.3"])
    assert args == ["--prefix_len=9", "--temperature", "0.3"]
    assert triforce_benchmark.translate(["--on_chip", "2"])[0][-1] == "--offload"
    _, named = triforce_benchmark.translate(["--model", "m.pth"])
    assert named["drafter"] == "hierarchy" and named["draft"] == "ngram" and named["draft_policy"] == "retrieval"
    assert (named["prefix_len"], named["draft_budget"], named["gamma"], named["temperature"]) == (32768, 4096, [6], 0.6)
    _, default_model = triforce_benchmark.translate([])  # SmolLM2's 8K context: a prefill that fits
    assert default_model["prefix_len"] == 4000 and default_model["draft_budget"] == 512
    record = triforce_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), "--draft", str(tiny["draft"]))
                                    + argv)
    assert record["config"]["prefix_len"] == PREFIX and record["config"]["draft_budget"] == 48
    assert record["config"]["draft_policy"] == "retrieval" and record["config"]["gamma"] == [4]
    assert record["draft_cache"].startswith("bottom: ") and record["decoding"] == "greedy"
    assert_lossless(record, tiny_baseline)


@pytest.mark.parametrize("method", ["baseline", "selfspec"])
def test_offloaded_target_end_to_end(tiny, jsonl, tiny_baseline, method):
    """--offload --on_chip 1: the tiny target's other layer's prompt KV on the host; the baseline script's ids."""
    argv = tiny_args(jsonl, "--model", str(tiny["target"]), "--offload", "--on_chip", "1")
    record = (baseline_benchmark.run(argv) if method == "baseline" else
              selfspec_benchmark.run(argv + ["--draft_policy", "retrieval", "--draft_budget", "48", "--gamma", "3"]))
    assert_lossless(record, tiny_baseline)
    assert record["offload"]["on_chip_layers"] == 1 and record["offload"]["offloaded_layers"] == 1


def test_offload_bad_input():
    base = (*SMALL, "--prefix_len", "64")
    one_line_error(cli("baseline", *base, "--offload", "--on_chip", "3"), "--on_chip 3: must be 0..2")
    one_line_error(cli("baseline", *base, "--on_chip", "1"), "add --offload")
    one_line_error(cli("baseline", *base, "--offload", "--compile"), "--step_mode compile")  # on a CPU: no compile


def test_offload_beyond_the_hosts_memory_is_one_line(monkeypatch):
    """TinyLlama's 22 layers at 1024 x 2000: ~90 GB of offloaded KV for the host, two layers' worth (16 GiB with the
    weights) on the "device". On a machine with 20 GiB free of 24 (set here: the outcome must not depend on what
    else the machine runs; with less free the device's share is what is refused) the device's share fits and the
    host's does not: refused in one line before the model is built."""
    from magicdec import device as dev
    from magicdec.harness.engine import Engine

    monkeypatch.setattr(dev, "memory", lambda device: (20 << 30, 24 << 30))
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("the model was built before the memory check"))
    one_line_error(cli("baseline", "--random_weights", "--model_name", "TinyLlama/TinyLlama_v1.1", "--B", "1024",
                       "--prefix_len", "2000", "--gen_len", "4", "--offload"), "GiB of host memory", "raise --on_chip")


def test_hierarchy_bad_input(tiny, jsonl):
    base = (*SMALL, "--prefix_len", "64", "--streamingllm_budget", "32")
    one_line_error(cli("selfspec", *base, "--hierarchy"), "the hierarchy needs a bottom draft", "--draft ngram")
    one_line_error(cli("selfspec", *base, "--draft", "ngram"), "--draft is an option of hierarchy, standalone",
                   "--drafter hierarchy")
    one_line_error(cli("selfspec", *base, "--hierarchy", "--draft", "ngram", "--gamma_bottom", "0"),
                   "--gamma_bottom 0")
    one_line_error(cli("selfspec", *base, "--hierarchy", "--draft_name", "JackFram/llama-68m",
                       "--synthetic_acceptance", "0.8"), "a rate for each level", "--synthetic_bottom")
    one_line_error(cli("selfspec", *base, "--hierarchy", "--draft_name", "JackFram/llama-68m"),
                   "--bottom_budget 256: must exceed --sinks 16 and stay below --prefix_len 64")
    one_line_error(cli("selfspec", *base, "--hierarchy", "--draft_name", "TinyLlama/TinyLlama_v1.1", "--model_name",
                       "meta-llama/Meta-Llama-3.1-8B", "--bottom_budget", "32"), "bottom draft vocabulary (32000) differs")


def test_prompt_lookup_end_to_end(tiny, jsonl, tiny_baseline):
    """tests/lookup_benchmark.py: no draft model; greedy gives the baseline script's ids, the record says what
    drafted, and the sampled run is seeded."""
    record = lookup_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA), "--ngram", "2",
                                            "--baseline"))
    m = check_spec_record(record, "lookup", B, GEN, GAMMA, with_baseline=True)
    assert_lossless(record, tiny_baseline)
    assert record["draft_cache"] == "none: prompt lookup (suffixes of 2 tokens down to 1)"
    spec = m["speculation"]
    assert 0 < spec["draft_steps"] <= GAMMA * spec["iterations"]  # as many tokens as were found, never more
    sampled = tiny_args(jsonl, "--model", str(tiny["target"]), "--gamma", str(GAMMA), "--temperature", "0.6")
    first = lookup_benchmark.run(sampled)
    assert first["decoding"].startswith("sampled") and lookup_benchmark.run(sampled)["generated_ids"] == first["generated_ids"]


def test_prompt_lookup_bad_input():
    one_line_error(cli("lookup", *SMALL, "--prefix_len", "64", "--ngram", "0"), "--ngram_max 0", "at least 1")
    one_line_error(cli("lookup", *SMALL, "--prefix_len", "64", "--gamma", "auto"), "--gamma auto", "--gamma N")


@pytest.mark.parametrize("method", ["selfspec", "longspec", "selfspec --refresh 2"])
@pytest.mark.parametrize("policy", ["snapkv", "retrieval"])
def test_selected_draft_end_to_end(tiny, jsonl, tiny_baseline, method, policy):
    """A selection policy through the script, for self-speculation (from the target's prefill, and re-selected
    every 2 verifications) and a standalone draft (from its own full prefill): lossless, and the record says where
    the draft's KV came from."""
    method, *refresh = method.split()
    models = ("--model", str(tiny["target"])) if method == "selfspec" else \
        ("--target", str(tiny["target"]), "--model", str(tiny["draft"]))
    record = (selfspec_benchmark if method == "selfspec" else longspec_benchmark).run(tiny_args(
        jsonl, *models, "--draft_policy", policy, "--draft_budget", "48", "--gamma", str(GAMMA), *refresh))
    assert ("--refresh" in record["draft_cache"]) == bool(refresh)
    check_spec_record(record, "standalone" if method == "longspec" else method, B, GEN, GAMMA, with_baseline=False)
    assert_lossless(record, tiny_baseline)
    assert 0.1 < record["metrics"]["alpha"] < 1
    assert record["draft_cache"].startswith(f"{policy}: selected per KV head from the "
                                            + ("target's prefill" if method == "selfspec" else "draft's own"))
    assert record["metrics"]["draft_prefill_s"] > 0


def test_reindexed_draft_runs_beyond_its_context(tiny, jsonl, tiny_baseline):
    """A draft trained on 40 positions under a 64-token prompt: refused with absolute positions (one line naming
    --reindex), lossless with --reindex, which keeps every query-key distance within the 24-token budget."""
    argv = tiny_args(jsonl, "--target", str(tiny["target"]), "--model", str(tiny["short"]), *SPEC_ARGS)
    one_line_error(cli("longspec", *argv), "exceeds the draft's context of 40", "--reindex keeps a draft within")
    one_line_error(cli("longspec", *argv, "--reindex"), "the draft would see 260 positions back",
                   "beyond its context of 40", "--prefill_chunk")
    record = longspec_benchmark.run([*argv, "--reindex", "--prefill_chunk", "16"])
    assert "--reindex" in record["draft_cache"]
    assert_lossless(record, tiny_baseline)
    assert 0.1 < record["metrics"]["alpha"] < 1


def test_reindexed_selfspec_is_lossless(tiny, jsonl, tiny_baseline):
    record = selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), *SPEC_ARGS, "--reindex"))
    assert_lossless(record, tiny_baseline)
    assert 0.1 < record["metrics"]["alpha"] < 1


def test_reindex_bad_input(tiny, jsonl):
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "48", "--reindex",
                       "--draft_policy", "snapkv"), "--reindex applies to --draft_policy streaming only")
    one_line_error(cli("longspec", *SMALL, "--draft_name", "JackFram/llama-68m", "--prefix_len", "64",
                       "--streamingllm_budget", "0", "--reindex"), "--reindex needs a StreamingLLM budget")
    one_line_error(cli("longspec", *SMALL, "--draft_name", "JackFram/llama-68m", "--prefix_len", "64",
                       "--streamingllm_budget", "0", "--draft_policy", "snapkv"), "--draft_budget 0 (the full")


@pytest.mark.parametrize("draft", [("--streamingllm_budget", "24", "--sinks", "4"),
                                   ("--draft_budget", "48", "--draft_policy", "snapkv")], ids=["streaming", "snapkv"])
def test_auto_gamma_end_to_end(tiny, jsonl, tiny_baseline, draft):
    """--gamma auto: profiles gamma 0..max_gamma on the batch, picks per verification, loses no token (with a
    StreamingLLM draft and with a selected one, whose profiling runs roll its appended tokens back too)."""
    record = selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), *draft, "--gamma", "auto",
                                              "--max_gamma", "3", "--baseline"))
    m = record["metrics"]
    auto = m["speculation"]["auto_gamma"]
    assert sorted(auto["seconds_per_verification"]) == [0, 1, 2, 3]
    assert all(s > 0 for s in auto["seconds_per_verification"].values())
    assert sum(auto["iterations_per_gamma"].values()) == m["iterations"] and m["auto_gamma_profile_s"] > 0
    # each verification drafts the gamma it picked: the draft steps add up from the gammas' counts
    assert m["speculation"]["draft_steps"] == sum(int(g) * n for g, n in auto["iterations_per_gamma"].items())
    check_speedup(record, B)
    assert "predicted_speedup" not in m
    assert_lossless(record, tiny_baseline)


def test_auto_gamma_with_a_tree_width_end_to_end(tiny, jsonl, tiny_baseline):
    """--gamma auto --tree_width 2: every chain and every width-2 tree of depth 1..max_gamma profiled on the batch,
    each verification a chain or a tree, no token lost."""
    record = selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), "--streamingllm_budget", "24",
                                              "--sinks", "4", "--gamma", "auto", "--max_gamma", "3", "--tree_width",
                                              "2", "--baseline"))
    m = record["metrics"]
    auto = m["speculation"]["auto_gamma"]
    assert sorted(map(int, auto["seconds_per_verification"])) == [0, 1, 2, 3]
    assert sorted(map(int, auto["tree_seconds_per_verification"])) == [1, 2, 3] and auto["tree_width"] == 2
    assert all(s > 0 for s in auto["tree_seconds_per_verification"].values())
    used = sum(auto["iterations_per_gamma"].values()) + sum(auto["tree_iterations_per_gamma"].values())
    assert used == m["iterations"]
    check_speedup(record, B)
    assert_lossless(record, tiny_baseline)


def test_several_gammas_in_one_run(tiny, jsonl, tiny_baseline):
    """--gamma 1 2 4: each gamma is timed on the same loaded model and caches, in turns with the baseline (its
    speedup is against those baseline runs); the record's metrics are the best measured speedup's, with the
    baseline it was measured against; every gamma's are kept, and no gamma loses a token."""
    record = selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), "--streamingllm_budget", "24",
                                              "--sinks", "4", "--gamma", "4", "1", "2", "--baseline"))
    sweep, m = record["gamma_sweep"], record["metrics"]
    assert sorted(sweep) == ["1", "2", "4"] and record["config"]["gamma"] == [4, 1, 2]
    for g, gm in sweep.items():
        assert 1 <= gm["omega"] <= int(g) + 1 and gm["speculation"]["draft_steps"] == int(g) * gm["iterations"]
        paired = gm["paired_baseline"]
        assert paired["iterations"] == GEN - 1 and paired["generated_tokens"] == gm["generated_tokens"]  # plain, same tokens
        assert gm["measured_speedup"] == pytest.approx(gm["decode_tokens_per_s"] / paired["decode_tokens_per_s"])
    assert m["measured_speedup"] == max(gm["measured_speedup"] for gm in sweep.values())
    assert m["gamma_chosen_by"] == "best of 3 gammas by the all-reach speedup, each timed in its own rounds with the " \
                                   "baseline"
    assert sweep[str(m["gamma"])]["decode_s"] == m["decode_s"]
    assert record["baseline_metrics"] == sweep[str(m["gamma"])]["paired_baseline"] and "paired_baseline" not in m
    assert_lossless(record, tiny_baseline)


def test_gamma_auto_takes_no_other_values():
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "32", "--gamma", "auto", "3"),
                   "--gamma auto takes no other values", "auto 3")


def test_auto_gamma_needs_a_candidate():
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "32", "--gamma", "auto",
                       "--max_gamma", "0"), "--max_gamma must be at least 1")


def test_auto_gamma_prior_must_be_a_rate():
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "32", "--gamma", "auto",
                       "--alpha_prior", "1.5"), "--alpha_prior must be in (0, 1)", "got 1.5")


@needs_smollm2
def test_selfspec_smollm2_end_to_end(smol_dir, tmp_path, monkeypatch):
    """The default model on real text: self-speculation with a 64-token StreamingLLM budget over 256-token prompts
    reproduces the baseline script's ids."""
    monkeypatch.setenv("MAGICDEC_CACHE", str(smol_dir.parent))  # the session's fresh conversion is the default
    common = ["--dataset", str(GUTENBERG), "--B", "2", "--prefix_len", "256", "--gen_len", "24", "--device", "cpu",
              "--no_progress", "--save_tokens"]
    out = tmp_path / "s.json"
    record = selfspec_benchmark.run(common + ["--streamingllm_budget", "64", "--gamma", str(GAMMA), "--baseline",
                                              "--output", str(out)])
    check_spec_record(record, "selfspec", 2, 24, GAMMA, with_baseline=True)
    check_saved(record, out)
    assert record["checkpoint"] == str(smol_dir / "model.pth") and "gutenberg" in record["prompt_source"]
    assert record["model_config"]["vocab_size"] == 49152
    base = baseline_benchmark.run(common)
    assert_lossless(record, base)
    lookup = lookup_benchmark.run(common + ["--gamma", str(GAMMA)])  # prompt lookup too: drafts from the book
    check_spec_record(lookup, "lookup", 2, 24, GAMMA, with_baseline=False)
    assert_lossless(lookup, base)


@pytest.mark.parametrize("method", ["selfspec", "longspec"])
def test_sampled_decoding(tiny, jsonl, method):
    models = (["--model", str(tiny["target"])] if method == "selfspec"
              else ["--target", str(tiny["target"]), "--model", str(tiny["draft"])])
    argv = tiny_args(jsonl, *models, *SPEC_ARGS, "--temperature", "0.6", "--top_p", "0.9")
    run = selfspec_benchmark.run if method == "selfspec" else longspec_benchmark.run
    record = run(argv)
    check_spec_record(record, "standalone" if method == "longspec" else method, B, GEN, GAMMA, with_baseline=False)
    assert record["decoding"].startswith("sampled") and "0.6" in record["decoding"] and "0.9" in record["decoding"]
    assert record["baseline_metrics"] is None
    assert all(0 <= t < 256 for row in record["generated_ids"] for t in row)
    if method == "selfspec":  # seeded: the same command gives the same tokens
        assert run(argv)["generated_ids"] == record["generated_ids"]


def test_synthetic_acceptance(small_random):
    """Random weights (a small model's shapes), each drafted token accepted with probability 0.8: the measured
    acceptance rate is near 0.8 (about 600 examined tokens: standard error ~0.016), Omega near the i.i.d. model's."""
    record = selfspec_benchmark.run([*SMALL_RANDOM, "--synthetic_acceptance", "0.8", "--B", "4", "--prefix_len", "64",
                                     "--gen_len", "200", "--streamingllm_budget", "32", "--sinks", "4", "--gamma",
                                     str(GAMMA), "--ignore_eos", "--device", "cpu", "--no_progress", "--save_tokens"])
    m = check_spec_record(record, "selfspec", 4, 200, GAMMA, with_baseline=False)
    assert record["synthetic_acceptance"] == 0.8 and record["random_weights"] is True
    assert record["prompt_source"].startswith("random token ids")
    assert record["generated_counts"] == [200] * 4
    assert abs(m["alpha"] - 0.8) < 0.15, m["alpha"]
    assert all(abs(p - 0.8) < 0.2 for p in m["speculation"]["per_position_acceptance"])
    omega_model = (1 - 0.8 ** (GAMMA + 1)) / (1 - 0.8)  # 2.95
    assert abs(m["omega"] - omega_model) < 0.4, m["omega"]


# ------------------------------------------------------------------ bad input: exit 2, one line, no traceback

def cli(method: str, *argv: str, peak: bool = False) -> subprocess.CompletedProcess:
    """The script with these flags: in this process (conftest.run_here), or, where its peak memory is checked, as
    its own process."""
    return run_cli(SCRIPTS[method], *argv, peak=True) if peak else run_here(SCRIPTS[method], *argv)


SMALL = (*LLAMA68M, "--B", "1", "--gen_len", "4")


@pytest.mark.parametrize("method", ["selfspec", "longspec"])
@pytest.mark.parametrize("budget", ["64", "100"])
def test_budget_not_below_prefix(method, budget):
    models = SMALL if method == "selfspec" else (*SMALL, "--draft_name", "JackFram/llama-68m")
    one_line_error(cli(method, *models, "--prefix_len", "64", "--streamingllm_budget", budget, "--sinks", "4"),
                   f"--draft_budget {budget} >= --prefix_len 64", "use a budget below the prefix length")


@pytest.mark.parametrize("budget", ["8", "4"])
def test_budget_not_above_sinks(budget):
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", budget, "--sinks", "8"),
                   f"--draft_budget {budget} must exceed --sinks 8", "recent window")


def test_gamma_zero():
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "32", "--gamma", "0"),
                   "--gamma must be at least 1", "got 0")


def test_draft_with_other_vocabulary_fails_fast():
    """Llama-3.1-8B (128256 tokens) drafted by TinyLlama (32000): refused from the configs, before any weights."""
    p = cli("longspec", "--random_weights", "--model_name", "meta-llama/Meta-Llama-3.1-8B",
            "--draft_name", "TinyLlama/TinyLlama_v1.1", peak=True)
    one_line_error(p, "draft vocabulary (32000) differs from the target's (128256)", "share the target's tokenizer")
    assert p.peak_rss_gib < 4  # never built the 8B target (32 GB in fp32) nor the 1.1B draft


def test_draft_with_other_tokenizer(tiny, jsonl):
    """Same vocabulary size, the same 256 strings, different ids: caught by encoding a probe text with both."""
    one_line_error(cli("longspec", *tiny_args(jsonl, "--target", str(tiny["target"]), "--model",
                                              str(tiny["permuted"]), *SPEC_ARGS)),
                   "draft and target tokenizers differ", "pick a draft trained with the target's tokenizer")


def test_draft_with_other_word_tokenizer(tiny, jsonl, tmp_path):
    data = tmp_path / "words.jsonl"
    gen = torch.Generator().manual_seed(0)
    data.write_text(json.dumps({"text": " ".join(WORDS[i] for i in torch.randint(0, 253, (600,), generator=gen))}))
    one_line_error(cli("longspec", *tiny_args(data, "--target", str(tiny["word_target"]), "--model",
                                              str(tiny["word_permuted"]), *SPEC_ARGS, "--gen_len", "4")),
                   "draft and target tokenizers differ")


def test_baseline_json_with_other_decoding_or_prompts(tmp_path):
    """A greedy baseline is not the baseline of a sampled run, nor one on other prompts: refused in one line."""
    base = tmp_path / "base.json"
    baseline_benchmark.run([*SMALL, "--prefix_len", "32", "--device", "cpu", "--no_progress", "--output", str(base)])
    spec = (*SMALL, "--prefix_len", "32", "--streamingllm_budget", "16", "--sinks", "4", "--baseline_json", str(base))
    one_line_error(cli("selfspec", *spec, "--temperature", "0.6"), "was run with temperature=0.0, this run has 0.6")
    one_line_error(cli("selfspec", *spec, "--seed", "3"), "was run with seed=0, this run has 3")
    one_line_error(cli("selfspec", *spec, "--baseline"), "--baseline times a baseline", "pass one of them")


def test_offload_on_a_cpu_says_what_it_checks(tiny, jsonl):
    p = cli("baseline", *tiny_args(jsonl, "--model", str(tiny["target"]), "--offload", "--on_chip", "1"))
    assert p.returncode == 0, p.stderr
    assert "note: --offload on a CPU: host and device memory are the same" in p.stderr


def test_baseline_json_with_other_batch(tmp_path):
    base = tmp_path / "base.json"
    baseline_benchmark.run([*SMALL, "--prefix_len", "32", "--device", "cpu", "--no_progress", "--output", str(base)])
    msg = one_line_error(cli("selfspec", *LLAMA68M, "--B", "2", "--gen_len", "4", "--prefix_len", "32",
                             "--streamingllm_budget", "16", "--sinks", "4", "--baseline_json", str(base)),
                         "was run with B=1, this run has 2", "compare like with like")
    assert str(base) in msg


def test_baseline_json_checked_before_loading(tmp_path, monkeypatch):
    from magicdec.harness.engine import Engine
    from magicdec.errors import MagicDecError

    base = tmp_path / "base.json"
    baseline_benchmark.run([*SMALL, "--prefix_len", "32", "--device", "cpu", "--no_progress", "--output", str(base)])

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before --baseline_json was checked")

    monkeypatch.setattr(Engine, "load", no_weights)
    with pytest.raises(MagicDecError, match="was run with B=1"):
        selfspec_benchmark.run([*LLAMA68M, "--B", "2", "--gen_len", "4", "--prefix_len", "32", "--streamingllm_budget",
                                "16", "--sinks", "4", "--baseline_json", str(base), "--device", "cpu", "--no_progress"])


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_synthetic_acceptance_out_of_range(value):
    one_line_error(cli("selfspec", *SMALL, "--prefix_len", "64", "--streamingllm_budget", "32",
                       "--synthetic_acceptance", value), "--synthetic_acceptance must be in [0, 1]", f"got {value}")


@pytest.mark.parametrize("change", ["device", "model"])
def test_baseline_json_from_other_device_or_model(tiny, jsonl, tiny_baseline, tmp_path, change):
    from magicdec.errors import MagicDecError

    record = json.loads(json.dumps(tiny_baseline))
    if change == "device":
        record["config"]["device"] = "cuda:0"
        record["environment"] |= {"device": "cuda:0", "gpu": "NVIDIA H100 80GB HBM3"}
    else:
        record["config"]["model"] = str(tiny["draft"])
        record["model_config"]["n_layers"] = 1
    base = tmp_path / "base.json"
    base.write_text(json.dumps(record))
    with pytest.raises(MagicDecError, match=change):
        selfspec_benchmark.run(tiny_args(jsonl, "--model", str(tiny["target"]), *SPEC_ARGS, "--baseline_json",
                                         str(base)))


def test_synthetic_acceptance_with_temperature_is_a_sampled_run():
    """Random weights at a synthetic rate with --temperature: the draft and the target sample (the record says
    sampled), acceptance comes from the coin flips; a tree has no synthetic sampled form and says so in one line."""
    from magicdec.errors import MagicDecError

    flags = [*LLAMA68M, "--synthetic_acceptance", "0.5", "--temperature", "0.6", "--top_p", "0.9", "--B", "2",
             "--prefix_len", "32", "--gen_len", "8", "--streamingllm_budget", "16", "--sinks", "4", "--device", "cpu",
             "--no_progress"]
    record = selfspec_benchmark.run(flags)
    assert record["decoding"].startswith("sampled"), record["decoding"]
    assert record["metrics"]["alpha"] is not None
    with pytest.raises(MagicDecError, match="tree"):
        selfspec_benchmark.run([*flags, "--tree_width", "2", "--synthetic_siblings", "0.3"])


# ------------------------------------------------------------------ llama2.c: tokenizer.bin beside model.pth



@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")
def test_selfspec_llama2c_tokenizer_bin(jsonl, tmp_path):
    """convert_llama2c writes tokenizer.bin beside model.pth; load_tokenizer reads it (the dir or the file), so the
    benchmark scripts cut real-text prompts with it, and self-speculation reproduces the baseline's ids."""
    from magicdec.model.checkpoint import Llama2cTokenizer, convert_llama2c
    from magicdec.errors import MagicDecError
    from magicdec.model.tokenizer import load_tokenizer

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    ref = Llama2cTokenizer(STORIES / "tok512.bin")
    for where in (model.parent, model.parent / "tokenizer.bin", STORIES / "tok512.bin"):
        tok = load_tokenizer(where)
        assert isinstance(tok, Llama2cTokenizer) and (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 512)
        text = "Once upon a time, there was a little girl"
        assert tok.encode(text) == ref.encode(text)
    truncated = tmp_path / "cut.bin"
    truncated.write_bytes((STORIES / "tok512.bin").read_bytes()[:2000])
    with pytest.raises(MagicDecError, match="truncated or corrupt") as e:
        load_tokenizer(truncated)
    assert "\n" not in str(e.value)

    common = ["--model", str(model), "--dataset", str(jsonl), "--skip_tokens", "0", "--B", "2", "--prefix_len", "64",
              "--gen_len", "24", "--device", "cpu", "--no_progress", "--save_tokens"]
    record = selfspec_benchmark.run(common + list(SPEC_ARGS))
    check_spec_record(record, "selfspec", 2, 24, GAMMA, with_baseline=False)
    prompts = record["prompt_ids"]
    assert all(p[0] == 1 for p in prompts)
    doc = json.loads(jsonl.read_text().splitlines()[0])["text"]
    assert ref.decode(prompts[0][1:]) in doc  # the prompt is the document's text, tokenized by tokenizer.bin
    assert_lossless(record, baseline_benchmark.run(common))


def test_skip_prefill_is_for_random_weights_only(tmp_path):
    record = selfspec_benchmark.run([*LLAMA68M, "--B", "2", "--prefix_len", "300", "--gen_len", "8",
                                     "--streamingllm_budget", "32", "--sinks", "4", "--skip_prefill",
                                     "--synthetic_acceptance", "0.8", "--baseline", "--device", "cpu", "--no_progress"])
    assert record["prefill"].startswith("skipped") and record["metrics"]["prefill_s"] is None
    assert record["metrics"]["generated_tokens"] == 2 * 8 and record["config"]["prefix_len"] == 300
    check_speedup(record, 2)
    one_line_error(cli("baseline", "--B", "1", "--prefix_len", "64", "--skip_prefill"), "--skip_prefill",
                   "only for --random_weights")


# ------------------------------------------------------------------ a disk that fills during the run

def test_a_full_disk_at_the_end_of_a_run_loses_no_measurement(tmp_path, monkeypatch, capsys):
    """`--output` on a disk with no room: the 0-byte writability check passes, the run runs, and the record cannot be
    written. It is kept in the system's temporary folder, named in the one-line error; the temporary file beside
    --output is gone. Where that folder is full too, the record is printed."""
    import errno
    import tempfile

    from magicdec.harness import run
    from magicdec.cli import run_main
    from test_files import faulty_disk, temporaries

    out = tmp_path / "results" / "run.json"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    faulty_disk(monkeypatch, out.parent, errno.ENOSPC, room=0)
    with pytest.raises(SystemExit) as e:
        run_main([*SMALL, "--prefix_len", "16", "--device", "cpu", "--no_progress", "--output", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write {out}: the disk is full; "), err
    (kept,) = (tmp_path / "tmp").glob("magicdec-record-*.json")
    assert f"the record is kept in {kept}: move it to {out} once there is room" in err[0]
    record = json.loads(kept.read_text())
    assert record["method"] == "baseline" and record["metrics"]["decode_tokens_per_s"] > 0
    assert not out.exists() and temporaries(out.parent) == []
    faulty_disk(monkeypatch, tmp_path / "tmp", errno.ENOSPC, room=0)
    with pytest.raises(run.MagicDecError, match="the record is printed above"):
        files.write_record(out, {"metrics": {"decode_tokens_per_s": 12.5}})
    assert json.loads(capsys.readouterr().out) == {"metrics": {"decode_tokens_per_s": 12.5}}
# ------------------------------------------------------------------ --replay, and what --no_progress shows

@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")
def test_replay_reruns_what_a_record_ran(tmp_path, monkeypatch):
    """A tiny CPU run's record, baseline and speculative (a gamma sweep), rerun with --replay: the same config, the
    same prompts, the same generated ids (greedy). A baseline's record failed ("--acceptance_trace applies to a
    speculative run"). Each run with --no_progress makes no bar that could show (the prompts' bar did)."""
    import magicdec.data
    import magicdec.decoding.generate
    from magicdec.model.checkpoint import convert_llama2c

    bars = []

    def tqdm(*args, **kwargs):
        bars.append((kwargs.get("desc"), kwargs.get("disable", False)))
        return real_tqdm(*args, **kwargs)

    real_tqdm = magicdec.data.tqdm
    monkeypatch.setattr(magicdec.data, "tqdm", tqdm)
    monkeypatch.setattr(magicdec.decoding.generate, "tqdm", tqdm)
    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    common = ["--model", str(model), "--dataset", "stdlib", "--skip_tokens", "0", "--B", "2", "--prefix_len", "48",
              "--gen_len", "12", "--device", "cpu", "--no_progress", "--save_tokens"]
    for kind in ([], ["--drafter", "lookup", "--gamma", "2", "3"]):
        first = run_record([*common, *kind, "--output", str(tmp_path / "first.json")])
        again = run_record(["--replay", str(tmp_path / "first.json"), "--output", str(tmp_path / "again.json"),
                            "--save_tokens", "--no_progress"])
        assert again["config_hash"] == first["config_hash"] and again["method"] == first["method"]
        assert again["prompt_ids"] == first["prompt_ids"] and again["generated_ids"] == first["generated_ids"]
        assert json.loads((tmp_path / "again.json").read_text())["config"]["output"] == str(tmp_path / "again.json")
    assert "prompts" in {desc for desc, _ in bars} and all(disabled for _, disabled in bars), bars


@pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"no stories260K in {STORIES}")
def test_a_source_too_small_for_the_batch_is_said_before_the_target_loads(tmp_path, monkeypatch):
    """The prompts are cut before the weights load: a dataset with fewer than B prompts of prefix_len is one line
    (it came after the target's weights had loaded: minutes for an 8B model)."""
    from magicdec.model.checkpoint import convert_llama2c
    from magicdec.harness.engine import Engine
    from magicdec.errors import MagicDecError

    model = convert_llama2c(STORIES / "stories260K.bin", tmp_path / "stories", STORIES / "tok512.bin")
    (tmp_path / "book.txt").write_text("Once upon a time there was a little girl. " * 20)
    monkeypatch.setattr(Engine, "load_target", lambda self: pytest.fail("the target was loaded"))
    with pytest.raises(MagicDecError, match="prompts of prefix_len 300 after skipping 0 tokens per document, but "
                                            "batch_size 4 were asked for") as e:
        run_record(["--model", str(model), "--dataset", str(tmp_path / "book.txt"), "--skip_tokens", "0", "--B", "4",
                    "--prefix_len", "300", "--gen_len", "4", "--device", "cpu", "--no_progress"])
    assert "\n" not in str(e.value)
