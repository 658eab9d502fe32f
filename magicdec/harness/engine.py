"""The one composition root: from a run config to what a run needs — the target (loaded or sharded), its KV cache
prefilled with the prompts, the drafter prepared over them, the decoders — for the command line, the sweep and every
benchmark script alike. Nothing else builds caches or drafters.

`Engine(cfg)` resolves the target and checks everything against the models' configs before anything large is
allocated (`plan`); then it loads, prefills and prepares, keeping loaded models so that a sweep reuses them across
points. magicdec.harness.trial runs one trial (prefill, prepare, decoders, timed rounds) on it; its `build(cfg)` readies one
run.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from magicdec import device as dev
from magicdec.drafters import draft_cache
from magicdec.model import fused, tp
from magicdec.decoding.acceptance import Acceptor
from magicdec.model.attention import resolve_backend
from magicdec.config import cache_slots, check_context, ModelArgs
from magicdec.drafters.base import ModelRef, Part, PrepareContext
from magicdec.errors import MagicDecError
from magicdec.model.forward_plan import LAST_LOGITS
from magicdec.decoding.generate import Decoder, prefill
from magicdec.model.kv_cache import KVCache
from magicdec.model.offload import OffloadedCache
from magicdec.analysis.planner import AutoGamma
from magicdec.harness.run_config import RunConfig
from magicdec.decoding.sampling import next_token


def resolve_model(ref: ModelRef, random_weights: bool) -> tuple[ModelArgs, Path | None]:
    """(config, checkpoint path or None) of a model, without loading its weights."""
    if random_weights:
        if not ref.name:
            raise MagicDecError(f"--random_weights needs {ref.flag}_name to pick the shapes")
        return ModelArgs.from_name(ref.name), None
    path = ref.path
    if path is None:
        if ref.flag != "--model":
            raise MagicDecError(f"{ref.flag} PATH/model.pth is needed")
        from magicdec.model.checkpoint import smollm2_checkpoint

        path = smollm2_checkpoint()
    path = Path(path)
    if path.is_dir():  # the dir convert_hf_checkpoint.py --checkpoint_dir wrote model.pth into
        if not (path / "model.pth").is_file():
            raise MagicDecError(f"{ref.flag} {path} is a directory without model.pth: make it with "
                                f"convert_hf_checkpoint.py --checkpoint_dir {path} (after download.py)")
        path = path / "model.pth"
    if not path.is_file():
        raise MagicDecError(f"{ref.flag}: no checkpoint at {path}: run download.py, then convert_hf_checkpoint.py "
                            "--checkpoint_dir DIR")
    config = ModelArgs.from_checkpoint_dir(path.parent)
    if ref.name:
        check_name(ref, config)
    check_contents(path, config, ref.flag)
    return config, path


def check_contents(path: Path, config: ModelArgs, flag: str) -> None:
    """Every tensor the config implies, with its shape, read from the memory-mapped file's index (no weight is
    read): a damaged or mismatched checkpoint fails before prompts or weights are loaded."""
    from magicdec.model.checkpoint import check_state_dict, load_state_dict

    try:
        state = load_state_dict(path)
        state = {k: v for k, v in state.items()
                 if "rotary" not in k and not (config.tie_embeddings and k == "output.weight")}
        check_state_dict(state, config, path)
    except MagicDecError as e:
        raise MagicDecError(f"{flag}: {e}") from None


SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size")


def check_name(ref: ModelRef, config: ModelArgs) -> None:
    """A repo id given beside a checkpoint must name what the checkpoint is: its shapes where the id is a known
    model's, else its name."""
    flag = f"{ref.flag}_name"
    try:
        known = ModelArgs.from_name(ref.name)
    except MagicDecError:
        known = None
    if known is not None:
        differ = [f for f in SHAPE_FIELDS if getattr(known, f) != getattr(config, f)]
        if differ:
            raise MagicDecError(f"{flag} {ref.name} contradicts the checkpoint's config.json ({differ[0]} "
                                f"{getattr(config, differ[0])}, not {getattr(known, differ[0])}): drop {flag} or pass "
                                "that model's checkpoint")
    elif ref.name.rstrip("/").split("/")[-1].lower() != (config.name or "").rstrip("/").split("/")[-1].lower():
        raise MagicDecError(f"{flag} {ref.name} contradicts the checkpoint's config.json, which names "
                            f"{config.name!r}: drop {flag} or pass that model's checkpoint")


def activation_rows(cfg) -> int:
    """Tokens per sequence a run's largest forward holds activations for: a prefill chunk, or (random KV in place
    of a prefill) a verification."""
    return cfg.lookahead + 1 if cfg.runtime.skip_prefill else cfg.runtime.prefill_chunk


def memory_needed(B: int, chunk: int, dtype, parts: list[Part]) -> dict:
    """Bytes a run will allocate, estimated before allocating: weights loaded, KV slots, and the activations of
    one prefill chunk across the batch plus a few verify positions' fp32 logits."""
    from magicdec.analysis.cost_model import weight_bytes as read_bytes

    item = torch.empty((), dtype=dtype).element_size()
    weights = sum(read_bytes(p.config, item) + (0 if p.config.tie_embeddings else item * p.config.vocab_size *
                                                p.config.dim) for p in parts if p.weights)
    weights += sum(p.extra_bytes for p in parts)
    kv = sum(KVCache.nbytes_for(p.config.n_layers, B, p.config.n_kv_heads, p.slots, p.config.head_dim, dtype)
             for p in parts) + B * sum(p.kv_bytes for p in parts)
    c = max((p.config for p in parts), key=lambda c: c.intermediate_size)
    h = c.n_heads * c.head_dim
    activations = (item * B * chunk * (4 * c.dim + 3 * c.intermediate_size + h + 2 * c.n_kv_heads * c.head_dim)
                   + 4 * B * c.vocab_size * 2 * 8)
    return {"weights": weights, "kv_cache": kv, "activations": activations, "total": weights + kv + activations}


def check_fits(need: dict, device: torch.device, B: int, prefix_len: int) -> None:
    free, spare = dev.memory(device)[0], dev.headroom(device)
    gib = 1 << 30
    if need["weights"] + spare > free:
        raise MagicDecError(f"the weights alone need {need['weights'] / gib:.1f} GiB (plus {spare / gib:.1f} GiB "
                            f"headroom) but only {free / gib:.1f} GiB is free on {device}: use a smaller model, more "
                            "tensor-parallel ranks, or a device with more memory")
    if need["total"] + spare > free:
        raise MagicDecError(
            f"B={B} at prefix_len {prefix_len} needs about {need['total'] / gib:.1f} GiB (weights "
            f"{need['weights'] / gib:.1f}, KV cache {need['kv_cache'] / gib:.1f}, activations "
            f"{need['activations'] / gib:.1f}) plus {spare / gib:.1f} GiB headroom but only {free / gib:.1f} GiB is "
            f"free on {device}; lower --B or --prefix_len (or --prefill_chunk)")


def check_host_fits(nbytes: int, what: str) -> None:
    """Host (pinned) memory for an offloaded cache, checked before anything is allocated."""
    free, total = dev.memory(torch.device("cpu"))
    spare = max(4 << 30, int(0.1 * total))
    if nbytes + spare > free:
        gib = 1 << 30
        raise MagicDecError(f"{what} needs {nbytes / gib:.1f} GiB of host memory plus {spare / gib:.1f} GiB headroom "
                            f"but only {free / gib:.1f} GiB is free; lower --B or --prefix_len, or raise --on_chip")


def target_slots(cfg: RunConfig, ahead: int | None = None) -> int:
    """The target cache's positions per sequence: the prompt and what generation reaches, a verification carrying
    `ahead` tokens at most (default: the config's own lookahead; a batch several configs share: the largest)."""
    w = cfg.workload
    return cache_slots(w.prefix_len, w.gen_len, cfg.lookahead if ahead is None else ahead)


@dataclass
class Prefilled:
    """The target's cache holding one batch of prompts, and what the prefill produced."""
    prompts: torch.Tensor  # [B, P] on the device
    cache: KVCache
    logits: torch.Tensor  # [B, V] at the last prompt position
    queries: list | None  # the prompt's last queries per layer, when a drafter selects from them
    seconds: float | None  # the prefill's (None: random KV stood in for it)
    prompt_source: str
    tokenizer: object = None
    features: torch.Tensor | None = None  # a head's hidden states of the prompt (DrafterKind.prefill_features)
    feature_positions: torch.Tensor | None = None


class Engine:
    """The target of one config (model, runtime), loaded once; prompts, caches and drafters made from it.

    `prompts(cfg) -> (prompts [B, P], tokenizer or None, where they came from)` is where a run's prompts come from
    (default: dataset_prompts, the config's dataset cut by the target's tokenizer); `load(config, checkpoint, shard,
    flag) -> model` makes a model (default: make_model, its checkpoint's weights or random ones). A benchmark hands
    the engine its own (prompts followed by their books' text, models on another library's tensors) instead of
    subclassing it; what they give is cached as the engine's own is."""

    def __init__(self, cfg: RunConfig, prompts=None, load=None):
        cfg.check()
        self.cfg = cfg
        self.prompt_source = prompts or self.dataset_prompts
        self.model_loader = load or self.make_model
        self.device, self.dtype = cfg.runtime.torch_device, cfg.runtime.torch_dtype
        self.rank, self.world = tp.init_distributed(self.device)
        self.target_config, self.checkpoint = resolve_model(
            ModelRef(cfg.models.model, cfg.models.model_name, "--model"), cfg.models.random_weights)
        self.check_ranks()
        self.backend = resolve_backend(cfg.runtime.attn_backend, self.device)
        self.target = self.target_shard = None
        self.all_reduce = None
        self.loaded: dict = {}
        self.resolved: dict = {}  # a drafter's models, resolved once (a checkpoint's index is read each time)
        self.tokenizer = None  # loaded once, when its prompts' source is checked
        self.last_prompts = None  # ((B, prefix_len, dataset, skip_tokens, seed), what prompts() made of them)

    def check_ranks(self) -> None:
        group, world = list(self.cfg.runtime.rank_group), self.world
        ranks, n = " ".join(map(str, group)), len(group)
        if world == 1:
            if group == [0]:
                return
            if sorted(group) == list(range(n)):  # a valid group for n processes, launched as one
                raise MagicDecError(f"--rank_group {ranks} needs {n} processes: launch with torchrun "
                                    f"--nproc_per_node={n} (or pass --rank_group 0 for one process)")
            raise MagicDecError(f"--rank_group {ranks}: rank ids must be 0..N-1 for an N-process job, each once; this "
                                "is one process, so use --rank_group 0")
        if sorted(group) != list(range(world)):
            raise MagicDecError(f"--rank_group {ranks} must list every rank of this {world}-process job once "
                                f"(0..{world - 1})")

    @property
    def local_target(self) -> ModelArgs:
        """This rank's slice of the target's shapes (for memory estimates)."""
        return tp.local_config(self.target_config, list(self.cfg.runtime.rank_group), self.rank)

    def plan(self, cfg: RunConfig) -> tuple[dict, list[Part]]:
        """Everything checked against the models' configs for a run of `cfg` on this engine's target: the drafter's
        other models resolved ({name: (ModelArgs, checkpoint)}) and this rank's memory parts. Loads nothing."""
        w, target = cfg.workload, self.target_config
        spec = cfg.speculation.speculative
        ahead = cfg.lookahead
        check_context(target, w.prefix_len, w.gen_len + ahead + 1 if spec else w.gen_len,
                      "gen_len + gamma + 1" if spec else "gen_len")
        if cfg.runtime.offload and not 0 <= cfg.runtime.on_chip <= target.n_layers:
            raise MagicDecError(f"--on_chip {cfg.runtime.on_chip}: must be 0..{target.n_layers} (the target's layers)")
        models = {}
        if cfg.drafter:
            models = {name: self.resolve(ref, cfg.models.random_weights) for name, ref in cfg.drafter.models(cfg).items()}
            cfg.drafter.check_models(cfg, target, models)
        local = self.local_target
        slots = target_slots(cfg)
        if cfg.runtime.offload:  # on the GPU: the on-chip layers, two layer slots, every offloaded layer's tail
            off = target.n_layers - cfg.runtime.on_chip
            device_slots = slots * (cfg.runtime.on_chip + 2) + off * (slots - w.prefix_len)
            parts = [Part(local, True, 0), Part(replace(local, n_layers=1), False, device_slots)]
        else:
            parts = [Part(local, True, slots)]
        if cfg.drafter:
            parts += cfg.drafter.memory(cfg, local, models, self.rank)
        return models, parts

    def resolve(self, ref: ModelRef, random_weights: bool) -> tuple[ModelArgs, Path | None]:
        """resolve_model, once per model: a sweep plans every point against the same drafts."""
        if (ref, random_weights) not in self.resolved:
            self.resolved[ref, random_weights] = resolve_model(ref, random_weights)
        return self.resolved[ref, random_weights]

    def check(self, cfg: RunConfig) -> dict:
        """plan(cfg), where its prompts come from, and its memory against what is free; returns the drafter's
        models."""
        self.check_prompts(cfg)
        models, parts = self.plan(cfg)
        need = memory_needed(cfg.workload.B, activation_rows(cfg), self.dtype, parts)
        check_fits(need, self.device, cfg.workload.B, cfg.workload.prefix_len)
        if cfg.runtime.offload:
            w = cfg.workload
            host = OffloadedCache.host_nbytes(self.target_config.n_layers, cfg.runtime.on_chip, w.B,
                                              self.local_target.n_kv_heads, w.prefix_len, self.target_config.head_dim,
                                              self.dtype)
            off = self.target_config.n_layers - cfg.runtime.on_chip
            check_host_fits(host, f"--offload of {off} layers at B={w.B} x {w.prefix_len}")
        return models

    def load_target(self):
        """The target's weights (this rank's shard), and the fused kernels switched on where the run asks."""
        if self.target is None:
            group = list(self.cfg.runtime.rank_group)
            if self.world > 1:
                self.target_shard = tp.make_shard(self.target_config, group, tp.group_for(group, self.world))
            torch.manual_seed(self.cfg.workload.seed)
            self.target = self.load(self.target_config, self.checkpoint, self.target_shard, "--model")
            rt = self.cfg.runtime
            if self.device.type == "cuda" and rt.step_mode != "compile" and rt.fuse:
                fused.fuse()
            self.all_reduce = tp.enable_fast_all_reduce(self.target_shard, self.device, self.dtype)
        return self.target

    def load(self, config: ModelArgs, checkpoint: Path | None, shard=None, flag: str = "--draft"):
        """A model (the engine's `load`), made once per engine: its config whole in the key, as two models of one
        name (a target and its first layers as a draft, both random) are two models."""
        key = (repr(config), str(checkpoint), None if shard is None else (shard.index, shard.size))
        if key not in self.loaded:
            self.loaded[key] = self.model_loader(config, checkpoint, shard, flag)
        return self.loaded[key]

    def make_model(self, config: ModelArgs, checkpoint: Path | None, shard=None, flag: str = "--draft"):
        """A model's weights, random at its shapes without a checkpoint."""
        from magicdec.model.transformer import build_model, load_model

        if checkpoint is None:
            return build_model(config, self.device, self.dtype, random_seed=self.cfg.workload.seed, shard=shard)
        try:
            return load_model(checkpoint, self.device, self.dtype, shard)
        except MagicDecError as e:  # a damaged file: say which flag named it
            raise MagicDecError(f"{flag}: {e}") from None

    def check_prompts(self, cfg: RunConfig) -> None:
        """Where the prompts come from, before any weight is loaded: the dataset and tokenizer where they are the
        engine's own (dataset_prompts); a prompt source handed to the engine is checked by whoever hands it."""
        if self.prompt_source == self.dataset_prompts:
            self.check_dataset(cfg)

    def check_dataset(self, cfg: RunConfig) -> None:
        """A --dataset that names a file or folder, then the tokenizer that cuts it (PG-19 and the other named sources
        are resolved when the prompts are made: that may ask the network)."""
        from magicdec import data
        if cfg.workload.dataset not in ("auto", "pg19", "stdlib"):
            data.resolve_source(cfg.workload.dataset)
        self.load_tokenizer()

    def load_tokenizer(self):
        """The tokenizer that cuts the prompts, checked against the target's config (None: random prompt ids)."""
        tok_path = self.tokenizer_path()
        if self.tokenizer is None and tok_path is not None:
            from magicdec.model.tokenizer import check_tokenizer, load_tokenizer

            tokenizer = load_tokenizer(tok_path)
            check_tokenizer(tokenizer, self.target_config, str(tok_path))
            self.tokenizer = tokenizer
        return self.tokenizer

    def tokenizer_path(self) -> Path | None:
        return self.cfg.models.tokenizer or (self.checkpoint.parent if self.checkpoint else None)

    def prompts(self, cfg: RunConfig):
        """(prompts [B, P], tokenizer or None, where they came from), from the engine's prompt source. The last batch
        made is kept: build makes it before the target loads (a source too small for it is said first), and the
        prefill takes it."""
        w = cfg.workload
        key = (w.B, w.prefix_len, w.dataset, w.skip_tokens, w.seed)
        if self.last_prompts is None or self.last_prompts[0] != key:
            self.last_prompts = (key, self.prompt_source(cfg))
        return self.last_prompts[1]

    def dataset_prompts(self, cfg: RunConfig):
        """The default prompt source: real text, or seeded random ids for random-weight runs with no tokenizer."""
        from magicdec import data
        w, config = cfg.workload, self.target_config
        tokenizer = self.load_tokenizer()
        if tokenizer is None:
            made = (data.random_prompts(config.vocab_size, w.B, w.prefix_len, w.seed, config.bos_id or 0), None,
                    "random token ids (random weights, no --tokenizer)")
        else:
            source = data.resolve_source(w.dataset)
            made = (data.load_prompts(tokenizer, w.B, w.prefix_len, source, w.skip_tokens, bos_id=config.bos_id,
                                      progress=cfg.output.progress), tokenizer, str(source))
        return made

    def new_cache(self, cfg: RunConfig, slots: int | None = None) -> KVCache:
        """The target's cache for `cfg`'s batch: `slots` positions per sequence (default: the prompt and what its
        generation reaches); offloaded past --on_chip layers where the run asks."""
        target, w, rt = self.target, cfg.workload, cfg.runtime
        slots = slots or target_slots(cfg)
        a = self.target_config
        if rt.offload:
            return OffloadedCache(a.n_layers, w.B, target.n_kv_heads, slots, a.head_dim, self.dtype, self.device,
                                  self.backend, rt.on_chip, w.prefix_len)
        return KVCache(a.n_layers, w.B, target.n_kv_heads, slots, a.head_dim, self.dtype, self.device, self.backend)

    def prefill(self, cfg: RunConfig, queries: int = 0, slots: int | None = None, features=None) -> Prefilled:
        """A batch of prompts in a new target cache: a chunked prefill (random KV for --skip_prefill), keeping the
        prompt's last `queries` queries per layer when a drafter selects from them, or the hidden states a head
        reads (`features`: DrafterKind.prefill_features's (taps, positions); with random KV, the last position's)."""
        prompts, tokenizer, source = self.prompts(cfg)
        prompts = prompts.to(self.device)
        target, rt = self.load_target(), cfg.runtime
        cache = self.new_cache(cfg, slots)
        progress = cfg.output.progress
        random_kv = cfg.workload.seed if rt.skip_prefill else None
        kept, seconds = None, None
        feats = positions = None
        with torch.inference_mode():
            if features is not None:
                from magicdec.decoding.generate import prefill_features

                taps, positions = features
                if random_kv is not None:  # random KV before the last token, which is fed for its features
                    cache.fill_random(cfg.workload.prefix_len - 1, random_kv)
                    logits, feats = prefill_features(target, cache, prompts[:, -1:], 1, taps)
                    positions = torch.tensor([prompts.shape[1] - 1])
                else:
                    (logits, feats), seconds = dev.timed(lambda: prefill_features(
                        target, cache, prompts, rt.prefill_chunk, taps, torch.as_tensor(positions), progress),
                        self.device)
            elif queries:
                (logits, kept), seconds = dev.timed(lambda: draft_cache.prefill_recording(
                    target, cache, prompts, queries, rt.prefill_chunk, progress, random_kv), self.device)
            elif random_kv is not None:
                cache.fill_random(cfg.workload.prefix_len, random_kv)
                logits = target(prompts[:, -1:], cache, LAST_LOGITS)[:, -1]
            else:
                logits, seconds = dev.timed(lambda: prefill(target, cache, prompts, rt.prefill_chunk, progress),
                                            self.device)
        return Prefilled(prompts, cache, logits, kept, seconds, source, tokenizer, feats,
                         None if positions is None else torch.as_tensor(positions))

    def prepare(self, cfg: RunConfig, batch: Prefilled, models: dict, ahead: int | None = None):
        """(the drafter over this batch, the seconds its preparation took, notes for the record)."""
        ctx = PrepareContext(cfg=cfg, target=self.target, cache=batch.cache, prompts=batch.prompts,
                             queries=batch.queries, lookahead=cfg.lookahead if ahead is None else ahead,
                             backend=self.backend, models=models, load=self.load, target_shard=self.target_shard,
                             rank=self.rank, world=self.world, tokenizer=self.tokenizer, features=batch.features,
                             feature_positions=batch.feature_positions)
        with torch.inference_mode():
            drafter, seconds = dev.timed(lambda: cfg.drafter.prepare(cfg, ctx), self.device)
        return drafter, seconds, ctx.notes

    def decoder(self, cfg: RunConfig, drafter=None, gamma: int = 0, policy: AutoGamma | None = None) -> Decoder:
        d, rt = cfg.decoding, cfg.runtime
        if drafter is not None:  # a prepared drafter serves points of any width and tree (--tree_nodes): a copy each
            drafter = drafter.shaped(cfg.speculation.tree_width, cfg.speculation.drafted_tree(gamma))
        acceptor = Acceptor.from_config(d, cfg.speculation if drafter is not None else None)
        return Decoder(self.target, acceptor, drafter=drafter, gamma=gamma, step_mode=rt.step_mode,
                       graph_target=not rt.offload, policy=policy, trace=cfg.output.save_trace)


def first_tokens(cfg: RunConfig, batch: Prefilled) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each sequence samples from the prefill's logits, the prompt's last token)."""
    torch.manual_seed(cfg.workload.seed)
    d = cfg.decoding
    return next_token(batch.logits, d.temperature, d.top_p, d.top_k), batch.prompts[:, -1]
