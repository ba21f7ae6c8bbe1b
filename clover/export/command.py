"""Compile a target (+ Augmenting Block) and its draft heads into an engine directory.

Examples::

    clover build --target demo --output engines/demo
    clover build --target path/to/hf-checkpoint --drafter path/to/heads --output engines/mine
    clover build --target demo --backend tensorrt --dtype fp16 --output engines/demo-trt
    clover build --target demo --target-weights fp32 --output engines/demo-fp32   # dequantised
    clover build --output engines/demo --recalibrate   # new cost model, no rebuild

The directory is self-contained: ``clover generate --engine DIR`` needs nothing else.
``python -m clover.export`` and, in a checkout, ``python export/build_engine.py`` take the same options.
"""

from __future__ import annotations

import argparse
import sys


from clover.config import PROPOSERS, ConfigError
from clover.progress import progress_bar


def parse_args(argv=None, prog: str = "clover build") -> argparse.Namespace:
    """The build's options (``prog``: the command's name in the usage: clover build, python -m clover.export)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo",
                   help="Hugging Face checkpoint directory (config.json + safetensors), or 'demo' (default)")
    p.add_argument("--drafter", default=None,
                   help="trained heads directory; 'demo-clover' or 'demo-medusa' for the heads shipped with "
                        "the demo target; 'none' for a vanilla-only engine; 'untrained' for untrained Clover heads "
                        "initialised from the target; default: demo-clover on the demo target, else untrained")
    p.add_argument("--output", required=True, help="engine directory to create")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime",
                   help="onnxruntime (CPU) or tensorrt (NVIDIA GPU; also writes .plan files) (default: onnxruntime)")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32", help="weights and activations (default: fp32)")
    p.add_argument("--attention", choices=["gqa", "standard", "plugin"], default=None,
                   help="gqa: onnxruntime's fused GroupQueryAttention, the KV cache written in place (fastest on "
                        "CPU); standard: standard ONNX ops; plugin: clover.TreeAttention nodes for TensorRT "
                        "(default: gqa for onnxruntime, plugin for tensorrt)")
    p.add_argument("--max-batch", type=int, default=32, help="largest batch the engine serves (default: 32)")
    p.add_argument("--max-tree", type=int, default=32, help="largest tree (draft nodes) per step (default: 32)")
    p.add_argument("--max-seq", type=int, default=2048, help="KV-cache length per sequence (default: 2048)")
    p.add_argument("--draft-top-k", type=int, default=8, help="candidates the draft step returns per node (default: 8)")
    p.add_argument("--num-heads", type=int, default=3, help="heads of the untrained default drafter (default: 3)")
    p.add_argument("--cache-dir", help="where the demo checkpoint is converted to "
                   "(default: $CLOVER_CACHE_DIR, else ~/.cache/clover)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="time the built engine against tokens in flight and store the cost model in engine.json; "
                        "decoding then picks each step's tree budget from it, so speculation never costs more "
                        "than it saves (seconds to a minute; default: on; --no-calibrate skips it)")
    p.add_argument("--calibrate-max-tokens", type=int, default=None,
                   help="largest tokens in flight to time (default: max-batch * (1 + max-tree), at most 256)")
    p.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="int8 weights for the draft step: its LM-head read shrinks 4x, so drafting costs about "
                        "half on CPU; only the proposals change, outputs stay lossless (the target is untouched). "
                        "Default: on for onnxruntime fp32 engines; --no-draft-int8 keeps fp32 drafts")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft step scores only the N most frequent tokens of the heads' draft_vocab.safetensors "
                        "(FR-Spec; written by training/draft_vocab.py): its LM-head cost shrinks by V/N; only the "
                        "proposals change, outputs stay lossless. 0: the full vocabulary. Default: the heads' own "
                        "draft_vocab_size (config.json; the full vocabulary for heads without one)")
    p.add_argument("--target-weights", choices=["fp32", "int8", "q4", "int4"], default=None,
                   help="the target's linear weights (onnxruntime fp32 engines; docs/quantized-target.md): q4 = "
                        "4-bit blocks (onnxruntime MatMulNBits; on the demo target the GGUF's own Q4_1 layers and "
                        "Q8_0 LM head, elsewhere quantized per block of 32), int4 = MatMulNBits' own symmetric 4-bit "
                        "blocks for every linear, LM head included (as onnxruntime-genai's builder), int8 = int8 per "
                        "output channel, fp32 = "
                        "as loaded. Decoding stays lossless against vanilla greedy on the same engine. Default: q4 "
                        "on the demo target, else fp32")
    p.add_argument("--target-compute", choices=["int8-exact", "fp32", "int8"], default=None,
                   help="activations in the quantized target's matmuls (docs/quantized-target.md): int8-exact = int8 "
                        "per block of 32 in Clover's own CPU kernel, which computes a token's logits bit for bit the "
                        "same whatever else the pass holds, so speculative output equals this engine's vanilla "
                        "output (q4 only; needs x86-64 with AVX2 and a C++ compiler, else target.onnx runs at fp32 "
                        "compute, with a one-line note); fp32 = onnxruntime MatMulNBits accuracy_level 1 (the fp32 "
                        "engine's answers, token-exact under speculation, slower); int8 = MatMulNBits accuracy_level "
                        "4 (fast, but NOT token-exact under speculation). Default: int8-exact for q4, int8 for int8 "
                        "and int4")
    p.add_argument("--proposer", choices=PROPOSERS, default=None,
                   help="model-free tree candidates the engine decodes with by default (engine.json tree_defaults; "
                        "clover generate --proposer and the serving parameter override it); default: suffix "
                        "(docs/trees.md#model-free-candidates)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing engine directory")
    p.add_argument("--recalibrate", action="store_true",
                   help="only measure and store a new cost model in the existing engine --output (cost models "
                        "belong to a machine: rerun after moving an engine; run it on an otherwise idle machine)")
    return p.parse_args(argv)


def main(argv=None, prog: str = "clover build") -> int:
    args = parse_args(argv, prog)
    # after the options are read: the builder loads torch, which --help and a bad option need not wait for
    from clover.export.builder import build_engine, default_draft_int8, default_target_weights, recalibrate_engine_dir

    bar = None

    def on_layer(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar(total=total, desc="target layers", unit="layer")
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    try:
        if args.recalibrate:
            recalibrate_engine_dir(args.output, args.calibrate_max_tokens)
            return 0
        build_engine(args.output, args.target, args.drafter, backend=args.backend, dtype=args.dtype,
                     attention=args.attention, max_batch=args.max_batch, max_tree=args.max_tree, max_seq=args.max_seq,
                     draft_top_k=args.draft_top_k, num_heads=args.num_heads, cache_dir=args.cache_dir,
                     overwrite=args.overwrite, calibrate=args.calibrate,
                     calibrate_max_tokens=args.calibrate_max_tokens, on_layer=on_layer,
                     draft_int8=default_draft_int8(args.backend, args.dtype) if args.draft_int8 is None
                     else args.draft_int8, draft_vocab=args.draft_vocab,
                     target_weights=args.target_weights or default_target_weights(args.target, args.backend, args.dtype),
                     target_compute=args.target_compute, proposer=args.proposer)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0

