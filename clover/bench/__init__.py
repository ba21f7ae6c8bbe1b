"""Measurement, outside the decode core: ``python -m clover.bench`` and the peer runtimes it compares against.

- :mod:`clover.bench.sweeps`: the benchmark command (interleaved sweeps, resumable samples, JSON, Markdown, PNGs).
- :mod:`clover.bench.genai`: onnxruntime-genai and its model builder's graph (the ``peers`` and ``passes`` sweeps).
- :mod:`clover.bench.llamacpp`: llama.cpp on the demo GGUF (the ``llamacpp`` and ``peers`` sweeps).

The product (clover/ outside this package) never imports it.
"""

from clover.bench.sweeps import PROMPTS, SWEEPS, Config, aims, main, paired_ratio, parse_args, run_decode

__all__ = ["PROMPTS", "SWEEPS", "Config", "aims", "main", "paired_ratio", "parse_args", "run_decode"]
