"""Per-token cost of training heads: the target's forward pass and one training step, time and memory.

    python -m training.experiments.cost_probe --target demo --device cpu --threads 2
    python -m training.experiments.cost_probe --shape llama3-8b --device cuda --grad-checkpoint   # random weights, bf16

Random token ids (the cost does not depend on the text), ``--batch-tokens`` per step in sequences of
``--seq-len``, the second half of each an answer (so about half the positions are roots). It times
:func:`training.features.online_hidden_states` (what ``train.py --features online`` adds to a step) and
``train.py``'s own optimizer step with those features given (all a step costs with a cache), after one
warm-up each, and prints one JSON line with tokens/s, peak memory and the parameter counts that
docs/train-your-own.md scales the estimates by. ``--shape`` builds a random-weight target of a
published model's shape directly on the device (no download), for the GPU check of issue 17.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from clover.config import TargetConfig
from training import batches as batches_mod
from training import forward as forward_mod
from training import train as train_mod
from training.features import online_hidden_states, online_target_dtype, peak_memory_mb, stored_dtype

SHAPES = {  # config.json values of the published checkpoints
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768,
                       qkv_bias=True, architecture="qwen2"),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=10000.0, max_position_embeddings=512),  # dry runs on a CPU
}


def random_target(shape: str, dtype: torch.dtype, device: torch.device):
    """A frozen target of ``SHAPES[shape]`` with random weights, made in ``dtype`` on ``device``."""
    from clover.target import LlamaTarget

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = LlamaTarget(TargetConfig(**SHAPES[shape]))
    finally:
        torch.set_default_dtype(previous)
    return target.requires_grad_(False).eval()


def probe_batch(vocab: int, batch_tokens: int, seq_len: int, device: torch.device) -> batches_mod.Batch:
    """Random conversations of ``seq_len`` tokens whose second half is the answer."""
    rows = max(1, batch_tokens // seq_len)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    assistant = (torch.arange(seq_len) >= seq_len // 2).expand(rows, -1)
    return batches_mod.Batch(None, None, tokens.to(device), assistant.to(device),
                           torch.full((rows,), seq_len, device=device), ["probe"] * rows)


def timed(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (all threads; what a shared CPU still measures) of ``fn()``
    over ``repeats`` runs after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def probe(args) -> dict:
    device = forward_mod.pick_device(args.device)
    if args.shape:
        target = random_target(args.shape, online_target_dtype(args.target_dtype, device, None), device)
    else:
        from clover.demo import resolve_target
        from clover.target import load_target

        directory = resolve_target(args.target)
        dtype = online_target_dtype(args.target_dtype, device, stored_dtype(directory))
        target = load_target(directory, dtype=dtype).to(device)
    batch = probe_batch(target.config.vocab_size, args.batch_tokens, args.seq_len, device)
    tokens = batch.tokens.numel()
    peak_memory_mb(device)  # reset the GPU peak: the target alone
    target_s, target_cpu = timed(lambda: online_hidden_states(target, batch.tokens, True, True), args.repeats, device)
    target_mb = peak_memory_mb(device)
    x_in, x_last = online_hidden_states(target, batch.tokens, True, True)
    full = batches_mod.Batch(x_in, x_last, batch.tokens, batch.assistant, batch.lengths, batch.categories)
    cfg = train_mod.TrainConfig(method=args.method, cache="-", output="-", num_heads=args.num_heads,
                                row_chunk=args.row_chunk, autocast=args.autocast, grad_checkpoint=args.grad_checkpoint,
                                labels=args.labels, draft_vocab=args.draft_vocab, draft_vocab_size=args.draft_vocab_size)
    trainer = train_mod.Trainer(cfg, target, device)
    roots = int(forward_mod.find_roots(full, args.num_heads).valid[:, 0].sum())
    step_s, step_cpu = timed(lambda: trainer.step([full], 1e-4), args.repeats, device)
    layer_params = sum(p.numel() for p in target.layers[0].parameters())
    return {"target": args.shape or args.target, "device": str(device),
            "target_dtype": str(target.lm_head.weight.dtype).removeprefix("torch."), "method": args.method,
            "labels": args.labels, "draft_vocab_size": args.draft_vocab_size if args.draft_vocab else 0,
            "autocast": args.autocast,
            "tokens_per_step": tokens,
            "roots_per_step": roots, "target_forward_s": round(target_s, 4),
            "target_tokens_per_s": round(tokens / target_s, 1), "train_step_s": round(step_s, 4),
            "train_tokens_per_s": round(tokens / step_s, 1),
            "online_tokens_per_s": round(tokens / (target_s + step_s), 1),
            "cpu_ms_per_token": {"target_forward": round(1e3 * target_cpu / tokens, 3),
                                 "train_step": round(1e3 * step_cpu / tokens, 3)},
            "peak_memory_mb": {"target_forward": target_mb, "train_step": peak_memory_mb(device)},
            "params": {"target": sum(p.numel() for p in target.parameters()),
                       "target_layers": layer_params * target.config.num_layers,
                       "lm_head": target.lm_head.weight.numel(),
                       "drafter_trainable": sum(p.numel() for p in trainer.params)},
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo'")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight target of this shape instead")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--target-dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    parser.add_argument("--method", default="clover", choices=train_mod.DRAFTER_METHODS)
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per step (one process)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--row-chunk", type=int, default=1024)
    parser.add_argument("--autocast", choices=("bf16",), default=None)
    parser.add_argument("--grad-checkpoint", action="store_true")
    parser.add_argument("--labels", choices=train_mod.LABELS, default="hard", help="as train.py --labels")
    parser.add_argument("--draft-vocab", metavar="DIR", default=None, help="as train.py --draft-vocab")
    parser.add_argument("--draft-vocab-size", type=int, default=16384, help="as train.py --draft-vocab-size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = probe(args)
    print(json.dumps(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
