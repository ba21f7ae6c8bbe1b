"""Hidden-state cache: run the frozen target once, keep what the heads need.

    python -m training.hidden_cache --distill data/distill/train.jsonl --target demo --output data/cache/train

For every conversation (``prompt_ids + response_ids`` from ``distill.py``, cut to
``--max-len`` tokens) one causal pass of the torch target stores, per token:

* ``last_layer_input.npy`` ``[N, H]``: the input of the target's last layer. The
  Augmenting Block is a trainable fork beside that layer, so training runs it
  over the whole conversation (causal) from this;
* ``last_hidden.npy`` ``[N, H]``: the last layer's output before the final norm
  (``h0`` for Medusa and ``clover-no-augment``);
* ``tokens.npy`` int32 ``[N]`` and ``assistant_mask.npy`` uint8 ``[N]`` (1 on the
  response tokens: the tokens the target generated, stop token included).

Arrays are memory-mapped ``.npy`` files (fp16 by default); conversations are
stored back to back, sorted by length, and ``index.json`` lists each one's
``offset``, ``length`` and ``num_prompt`` plus the target's fingerprint.

Resumable: the layout is planned first (``plan.json``); ``progress.json`` counts
the conversations whose rows are flushed, and a rerun continues from there.
``index.json`` is written last and marks a complete cache.

Disk: ``2 x H x 2`` bytes per token in fp16 plus 5 (2,309 bytes for the demo
target's H = 576: 2.3 GB per million tokens). The build prints it first and
``index.json`` records it (``disk_bytes``). Where that is not worth it (one
epoch, or data that changes), ``train.py --cache FILE.jsonl`` computes the same
arrays on the fly instead (:class:`LiveFeatures`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

CACHE_VERSION = 1
INDEX_FILE, PLAN_FILE, PROGRESS_FILE = "index.json", "plan.json", "progress.json"
HIDDEN_FIELDS = ("last_layer_input", "last_hidden")
DTYPES = {"float16": np.float16, "float32": np.float32}


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def target_hidden_states(target, input_ids, capture_layers=()):
    """(last_layer_input, last_hidden) ``[B, T, H]`` of one causal pass with no cache.

    The same arithmetic as :meth:`clover.target.LlamaTarget.forward` (layer by
    layer, the packed causal mask, empty caches) without the LM head, whose
    ``[B, T, V]`` logits the cache never needs. With ``capture_layers`` (the heads'
    ``feature_layers``) the first result is instead the inputs of those layers
    concatenated, ``[B, T, k*H]``: the Augmenting Block's multi-layer features.
    """
    import torch

    from clover.attention import causal_packed_mask

    cfg = target.config
    batch, length = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(length, device=device).expand(batch, -1)
    cos, sin = target.rope(position_ids)
    past = torch.zeros(batch, dtype=torch.int32, device=device)
    mask = causal_packed_mask(batch, length, device)
    dtype = target.embed_tokens.weight.dtype
    empty = torch.zeros(batch, cfg.num_kv_heads, 0, cfg.head_dim, dtype=dtype, device=device)
    x = target.embed_tokens(input_ids)
    last_input, captured = x, {}
    for i, layer in enumerate(target.layers):
        last_input = captured[i] = x
        x, _, _ = layer(x, cos, sin, past, mask, empty, empty)
    if capture_layers:
        return torch.cat([captured[i] for i in capture_layers], dim=-1), x
    return last_input, x


class OnnxFeatures:
    """The same two hidden states from an onnxruntime *feature engine* (about 2x faster than torch on CPU).

    A feature engine is an ordinary engine directory (``clover.export.builder.build_engine``)
    whose Augmenting Block is an exact identity (its attention output and MLP
    down projections are zero), so its ``h0`` output is the input of the target's
    last layer. :func:`make_feature_engine` builds one. ``last_hidden`` is then
    the target's own last layer applied to it in torch (1/L of the model).
    Opening one checks numerically that its ``h0`` is that input.
    """

    def __init__(self, engine_dir: str | Path, target, threads: int | None = None) -> None:
        import torch

        from clover.backends.onnxruntime import OnnxRuntimeEngine
        from clover.config import ConfigError

        self.engine = OnnxRuntimeEngine(engine_dir, threads=threads)
        self.target = target
        if self.engine.spec.num_kv_layers != target.config.num_layers + 1:
            raise ConfigError(f"{engine_dir}: not a feature engine (no Augmenting Block); build one with "
                              "--make-feature-engine")
        probe = torch.arange(1, 17).remainder(target.config.vocab_size)[None]
        expected, _ = target_hidden_states(target, probe)
        got, _ = self.hidden_states(probe)
        scale = float(expected.abs().max()) + 1.0
        if float((got - expected).abs().max()) > 1e-3 * scale:
            raise ConfigError(f"{engine_dir}: its h0 is not the input of the target's last layer (a Clover engine "
                              "with trained heads, or another target?); build one with --make-feature-engine")

    def hidden_states(self, input_ids):
        import torch

        from clover.attention import causal_packed_mask

        spec = self.engine.spec
        batch, length = input_ids.shape
        empty = [torch.zeros(batch, spec.num_kv_heads, 0, spec.head_dim, dtype=spec.dtype)
                 for _ in range(spec.num_kv_layers)]
        result = self.engine.target(input_ids.cpu(), torch.arange(length).expand(batch, -1).contiguous(),
                                    torch.zeros(batch, dtype=torch.int32), causal_packed_mask(batch, length),
                                    empty, empty)
        last_input = result.h0.float()
        cfg, layer = self.target.config, self.target.layers[-1]
        cos, sin = self.target.rope(torch.arange(length).expand(batch, -1))
        kv = torch.zeros(batch, cfg.num_kv_heads, 0, cfg.head_dim, dtype=last_input.dtype)
        with torch.inference_mode():
            last_hidden, _, _ = layer(last_input, cos, sin, torch.zeros(batch, dtype=torch.int32),
                                      causal_packed_mask(batch, length), kv, kv)
        return last_input, last_hidden


def make_feature_engine(output: str | Path, target_dir: str | Path, max_seq: int = 1024, overwrite: bool = False,
                        progress=None) -> Path:
    """Build an onnxruntime engine whose ``h0`` is the input of the target's last layer (see :class:`OnnxFeatures`)."""
    import shutil
    import tempfile

    import torch

    from clover.drafters import Drafter, save_drafter
    from clover.export.builder import build_engine
    from clover.target import load_target

    target = load_target(target_dir)
    heads = Drafter.untrained(target, "clover", num_heads=1)
    with torch.no_grad():  # the Augmenting Block becomes x + 0 + 0
        heads.augment.self_attn.o_proj.weight.zero_()
        heads.augment.mlp.down_proj.weight.zero_()
        for module in (heads.augment.self_attn.o_proj, heads.augment.mlp.down_proj):
            if module.bias is not None:
                module.bias.zero_()
    tmp = Path(tempfile.mkdtemp(prefix="clover-feature-heads-"))
    try:
        save_drafter(heads, tmp)  # fp32: exact zeros either way
        kwargs = {"progress": progress} if progress is not None else {}
        return build_engine(output, str(target_dir), str(tmp), max_seq=max_seq, draft_top_k=1, num_heads=1,
                            overwrite=overwrite, **kwargs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def conversation_tokens(record: dict, max_len: int) -> tuple[list[int], int] | None:
    """(token ids, number of prompt tokens), or None when no response token fits."""
    prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
    ids = (prompt + response)[:max_len]
    if len(ids) - len(prompt) < 2:  # a head needs at least a root token and one label
        return None
    return ids, len(prompt)


def plan_layout(records: list[dict], max_len: int) -> list[dict]:
    """Storage order (by length, then id) with offsets."""
    items = []
    for record in records:
        conv = conversation_tokens(record, max_len)
        if conv is not None:
            items.append({"id": record["id"], "category": record.get("category", ""), "length": len(conv[0]),
                          "num_prompt": conv[1]})
    items.sort(key=lambda it: (it["length"], it["id"]))
    offset = 0
    for it in items:
        it["offset"] = offset
        offset += it["length"]
    return items


def disk_bytes(num_tokens: int, hidden_size: int, dtype: str = "float16") -> int:
    """Bytes a cache of ``num_tokens`` takes: two hidden fields, int32 tokens, uint8 mask."""
    return num_tokens * (len(HIDDEN_FIELDS) * hidden_size * np.dtype(DTYPES[dtype]).itemsize + 4 + 1)


def _plan_digest(plan: list[dict], meta: dict) -> str:
    return hashlib.sha256(json.dumps([plan, meta], sort_keys=True).encode()).hexdigest()[:16]


def build_cache(records: list[dict], target, output: str | Path, *, max_len: int = 1024, batch_tokens: int = 2048,
                dtype: str = "float16", device: str = "cpu", progress: bool = True, source: str = "",
                features: OnnxFeatures | None = None, stop_after_batches: int | None = None) -> Path:
    """Build (or resume) the cache in ``output``; returns its path. See the module docstring.

    ``features``: compute the hidden states with an onnxruntime feature engine
    instead of the torch target. ``stop_after_batches`` stops early (tests use
    it to simulate a kill).
    """
    from clover.progress import progress_bar

    from clover.target import target_fingerprint

    output = Path(output)
    if (output / INDEX_FILE).exists():
        return output
    output.mkdir(parents=True, exist_ok=True)
    cfg = target.config
    meta = {"version": CACHE_VERSION, "hidden_size": cfg.hidden_size, "dtype": dtype, "max_len": max_len,
            "target_fingerprint": target_fingerprint(target), "target_num_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size}
    plan = plan_layout(records, max_len)
    if not plan:
        raise ValueError("no conversation has a response token within --max-len; nothing to cache")
    resume = _claim_plan(output, plan, meta)
    total = plan[-1]["offset"] + plan[-1]["length"]
    if progress:
        print(f"hidden cache: {len(plan)} conversations, {total:,} tokens, "
              f"{disk_bytes(total, cfg.hidden_size, dtype) / 1e9:.2f} GB on disk in {output}", file=sys.stderr)
    arrays = _open_arrays(output, total, cfg.hidden_size, DTYPES[dtype], mode="r+" if resume else "w+")
    done = _conversations_done(output) if resume else 0
    by_id = {r["id"]: r for r in records}
    target = target.to(device)
    bar = progress_bar(total=total, initial=plan[done]["offset"] if done < len(plan) else total, unit="tok", unit_scale=True,
               enabled=progress, dynamic_ncols=True, desc="hidden cache")
    t0 = time.monotonic()
    for n, (lo, hi) in enumerate(_batch_ranges(plan, done, batch_tokens)):
        if stop_after_batches is not None and n >= stop_after_batches:
            break
        items = plan[lo:hi]
        ids = _padded_token_ids([conversation_tokens(by_id[it["id"]], max_len)[0] for it in items])
        _store_batch(arrays, items, ids, *_hidden_states(target, features, ids, device))
        _write_json_atomic(output / PROGRESS_FILE, {"done": hi})
        bar.update(sum(it["length"] for it in items))
    else:
        index = dict(meta, num_tokens=total, num_conversations=len(plan),
                     num_assistant_tokens=int(sum(it["length"] - it["num_prompt"] for it in plan)),
                     source=source, backend="onnxruntime" if features is not None else "torch",
                     disk_bytes=disk_bytes(total, cfg.hidden_size, dtype),
                     seconds_last_run=round(time.monotonic() - t0, 1), conversations=plan)
        _write_json_atomic(output / INDEX_FILE, index)
    bar.close()
    return output


def _claim_plan(output: Path, plan: list[dict], meta: dict) -> bool:
    """Write ``plan.json``, or check the one a partial build left; True when resuming that build."""
    digest = _plan_digest(plan, meta)
    plan_path = output / PLAN_FILE
    if not plan_path.exists():
        _write_json_atomic(plan_path, {"digest": digest, "meta": meta, "conversations": plan})
        return False
    if json.loads(plan_path.read_text()).get("digest") != digest:
        raise ValueError(f"{output} holds a partial cache of other conversations or settings; "
                         "delete it or choose another --output")
    return True


def _conversations_done(output: Path) -> int:
    """How many conversations (in plan order) an interrupted build flushed."""
    progress_path = output / PROGRESS_FILE
    return json.loads(progress_path.read_text())["done"] if progress_path.exists() else 0


def _open_arrays(output: Path, total: int, hidden_size: int, hidden_dtype, mode: str) -> dict[str, np.ndarray]:
    """The cache's memory-mapped arrays: hidden fields ``[total, H]``, tokens and assistant_mask ``[total]``."""
    arrays = {name: np.lib.format.open_memmap(output / f"{name}.npy", mode=mode, dtype=hidden_dtype,
                                              shape=(total, hidden_size)) for name in HIDDEN_FIELDS}
    arrays["tokens"] = np.lib.format.open_memmap(output / "tokens.npy", mode=mode, dtype=np.int32, shape=(total,))
    arrays["assistant_mask"] = np.lib.format.open_memmap(output / "assistant_mask.npy", mode=mode, dtype=np.uint8,
                                                         shape=(total,))
    return arrays


def _batch_ranges(plan: list[dict], start: int, batch_tokens: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive conversations from ``start`` (similar lengths), each within
    ``batch_tokens`` padded tokens (a longer conversation goes alone)."""
    ranges = []
    while start < len(plan):
        end = start + 1
        while end < len(plan) and (end + 1 - start) * plan[end]["length"] <= batch_tokens:
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def _padded_token_ids(conversations: list[list[int]]):
    """int64 ``[B, T]``: the conversations right-padded with 0 to the longest."""
    import torch

    ids = torch.zeros(len(conversations), max(len(c) for c in conversations), dtype=torch.long)
    for row, tokens in enumerate(conversations):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    return ids


def _hidden_states(target, features: OnnxFeatures | None, ids, device: str) -> tuple[np.ndarray, np.ndarray]:
    """(last_layer_input, last_hidden) float32 ``[B, T, H]`` for ``ids`` ``[B, T]``, from the feature engine if any."""
    import torch

    if features is not None:
        last_input, last_hidden = features.hidden_states(ids)
    else:
        with torch.inference_mode():
            last_input, last_hidden = target_hidden_states(target, ids.to(device))
    return last_input.float().cpu().numpy(), last_hidden.float().cpu().numpy()


def _store_batch(arrays: dict[str, np.ndarray], items: list[dict], ids, last_input: np.ndarray,
                 last_hidden: np.ndarray) -> None:
    """Write one batch's rows (``ids [B, T]``, hidden states ``[B, T, H]``) at the items' offsets, and flush."""
    for row, it in enumerate(items):
        sl = slice(it["offset"], it["offset"] + it["length"])
        arrays["last_layer_input"][sl] = last_input[row, : it["length"]]
        arrays["last_hidden"][sl] = last_hidden[row, : it["length"]]
        arrays["tokens"][sl] = ids[row, : it["length"]].numpy()
        mask = np.zeros(it["length"], dtype=np.uint8)
        mask[it["num_prompt"]:] = 1
        arrays["assistant_mask"][sl] = mask
    for array in arrays.values():
        array.flush()


class _ConversationSource:
    """What training reads: ``conversations`` (index entries), ``index`` and ``conversation(i)``'s arrays."""

    conversations: list[dict]
    index: dict
    directory: Path

    def __len__(self) -> int:
        return len(self.conversations)

    @property
    def hidden_size(self) -> int:
        return self.index["hidden_size"]

    def check_target(self, target) -> None:
        """Raise :class:`clover.config.ConfigError` when the cache was made with another target."""
        from clover.config import ConfigError
        from clover.target import target_fingerprint

        actual = target_fingerprint(target)
        if self.index["target_fingerprint"] != actual:
            raise ConfigError(f"{self.directory} was built with target {self.index['target_fingerprint']}, "
                              f"not this target ({actual}); rebuild the cache")


class HiddenCache(_ConversationSource):
    """Read side of a finished cache: memory-mapped arrays plus the index."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / INDEX_FILE
        if not path.exists():
            hint = " (incomplete: rerun hidden_cache.py to finish it)" if (self.directory / PLAN_FILE).exists() else ""
            raise FileNotFoundError(f"{self.directory}: not a finished hidden-state cache{hint}")
        self.index = json.loads(path.read_text())
        if self.index.get("version") != CACHE_VERSION:
            raise ValueError(f"{path}: cache version {self.index.get('version')} != {CACHE_VERSION}; rebuild it")
        self.conversations: list[dict] = self.index["conversations"]
        self.arrays = {name: np.load(self.directory / f"{name}.npy", mmap_mode="r")
                       for name in (*HIDDEN_FIELDS, "tokens", "assistant_mask")}

    def conversation(self, i: int) -> dict[str, np.ndarray]:
        it = self.conversations[i]
        sl = slice(it["offset"], it["offset"] + it["length"])
        return {name: array[sl] for name, array in self.arrays.items()}

    def tokens(self, i: int) -> dict[str, np.ndarray]:
        """``tokens`` and ``assistant_mask`` of conversation ``i`` only (``train.py --features online``)."""
        conv = self.conversation(i)
        return {"tokens": conv["tokens"], "assistant_mask": conv["assistant_mask"]}


class LiveFeatures(_ConversationSource):
    """A :class:`HiddenCache` look-alike over a distilled JSONL that runs the torch target per conversation.

    No disk, one target pass per conversation per epoch: worth it when the data
    is read about once (docs in training/README.md#hidden-state-cache).
    """

    def __init__(self, records: list[dict], target, max_len: int = 1024, source: str = "",
                 capture_layers=()) -> None:
        from clover.target import target_fingerprint

        self.target, self.max_len, self.directory = target, max_len, Path(source or "live")
        self.capture_layers = tuple(capture_layers)  # multi-layer features: "last_layer_input" holds them
        self.conversations = plan_layout(records, max_len)
        self.records = {r["id"]: r for r in records}
        self.index = {"num_tokens": sum(c["length"] for c in self.conversations), "hidden_size": target.config.hidden_size,
                      "target_fingerprint": target_fingerprint(target), "source": source, "backend": "live"}

    def tokens(self, i: int) -> dict[str, np.ndarray]:
        """``tokens`` and ``assistant_mask`` of conversation ``i``, with no target pass."""
        ids, num_prompt = conversation_tokens(self.records[self.conversations[i]["id"]], self.max_len)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[num_prompt:] = 1
        return {"tokens": np.asarray(ids, dtype=np.int32), "assistant_mask": mask}

    def conversation(self, i: int) -> dict[str, np.ndarray]:
        import torch

        conv = self.tokens(i)
        with torch.inference_mode():
            last_input, last_hidden = target_hidden_states(self.target, torch.from_numpy(conv["tokens"]).long()[None],
                                                           self.capture_layers)
        return {"last_layer_input": last_input[0].float().numpy(), "last_hidden": last_hidden[0].float().numpy(),
                **conv}


class ConcatCache(_ConversationSource):
    """Several caches read as one (e.g. ShareGPT plus the 8-category data): conversations back to back."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.directory = Path(",".join(str(p.directory) for p in parts))
        self.conversations = [c for p in parts for c in p.conversations]
        self._where = [(k, j) for k, p in enumerate(parts) for j in range(len(p))]
        self.index = {"num_tokens": sum(p.index["num_tokens"] for p in parts), "hidden_size": parts[0].hidden_size,
                      "target_fingerprint": parts[0].index["target_fingerprint"],
                      "source": " + ".join(str(p.index.get("source", "")) for p in parts)}

    def conversation(self, i: int) -> dict[str, np.ndarray]:
        k, j = self._where[i]
        return self.parts[k].conversation(j)

    def tokens(self, i: int) -> dict[str, np.ndarray]:
        k, j = self._where[i]
        return self.parts[k].tokens(j)

    def check_target(self, target) -> None:
        for part in self.parts:
            part.check_target(target)


def open_training_data(spec: str, target=None, max_len: int = 1024, capture_layers=(), tokens_only: bool = False):
    """``train.py --cache``: comma-separated cache directories and/or distilled ``.jsonl`` files (on the fly).

    ``capture_layers``: the heads' multi-layer features, which a cache directory does not store (it keeps the last
    layer's input), unless only its tokens are read (``tokens_only``: ``--features online``)."""
    from clover.config import ConfigError
    from training.distill import read_jsonl

    parts = []
    for item in (s.strip() for s in str(spec).split(",")):
        if item.endswith(".jsonl"):
            parts.append(LiveFeatures(read_jsonl(item), target, max_len=max_len, source=item,
                                      capture_layers=capture_layers))
        elif item:
            if capture_layers and not tokens_only:
                raise ConfigError(f"{item}: a hidden-state cache holds the last layer's input only; multi-layer "
                                  "features need --features online or a distilled .jsonl (computed on the fly)")
            parts.append(HiddenCache(item))
    if not parts:
        raise FileNotFoundError(f"no training data in {spec!r}")
    return parts[0] if len(parts) == 1 else ConcatCache(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distill", help="conversation JSONL from distill.py")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo'")
    parser.add_argument("--output", help="cache directory")
    parser.add_argument("--engine", help="onnxruntime feature engine (faster on CPU); default: the torch target")
    parser.add_argument("--make-feature-engine", metavar="DIR",
                        help="build a feature engine for --target into DIR and exit")
    parser.add_argument("--max-len", type=int, default=1024, help="tokens kept per conversation")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per target pass")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None,
                        help="only the first N records of --distill (after --offset; ShareGPT files are in a "
                             "mixed order)")
    parser.add_argument("--offset", type=int, default=0,
                        help="skip the first N records of --distill: grow the training data in parts, each its own "
                             "cache, usable once sealed (train.py --cache takes them comma-separated)")
    args = parser.parse_args(argv)

    import torch

    from clover.demo import resolve_target
    from clover.target import load_target
    from training.distill import read_jsonl

    from clover.config import ConfigError

    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    if args.make_feature_engine:
        make_feature_engine(args.make_feature_engine, target_dir, max_seq=args.max_len, overwrite=True)
        return 0
    if not args.distill or not args.output:
        parser.error("--distill and --output are required (unless --make-feature-engine)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    target = load_target(target_dir)
    try:
        features = OnnxFeatures(args.engine, target, threads=args.threads) if args.engine else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    records = read_jsonl(args.distill)[args.offset:]
    records = records[: args.limit] if args.limit is not None else records
    if not records:
        parser.error(f"--offset {args.offset}: {args.distill} has no records past it")
    out = build_cache(records, target, args.output, max_len=args.max_len, batch_tokens=args.batch_tokens,
                      dtype=args.dtype, device=device, source=str(args.distill), features=features)
    index = json.loads((out / INDEX_FILE).read_text())
    print(f"{out}: {index['num_conversations']} conversations, {index['num_tokens']} tokens "
          f"({index['num_assistant_tokens']} assistant), {index['disk_bytes'] / 1e9:.2f} GB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
