"""Measurement, outside the decode core: ``python -m clover.bench`` and the peer runtimes it compares against.

- :mod:`clover.bench.cli`: its command line (no torch, so ``--help`` is quick).
- :mod:`clover.bench.sweeps`: the benchmark command: the configurations, interleaved sweeps, the measurements.
- :mod:`clover.bench.samples`: the samples on disk, so a killed run resumes.
- :mod:`clover.bench.report`: medians and ranges, the aims as paired ratios, ``bench.md`` and the PNGs.
- :mod:`clover.bench.genai`: onnxruntime-genai and its model builder's graph (the ``peers`` and ``passes`` sweeps).
- :mod:`clover.bench.llamacpp`: llama.cpp on the demo GGUF (the ``llamacpp`` and ``peers`` sweeps).

The product (clover/ outside this package) never imports it.
"""

import importlib

from clover.bench.cli import SWEEPS, parse_args

# loaded on first use: they import torch, and ``python -m clover.bench --help`` loads this package first
_LAZY = {"PROMPTS": "sweeps", "Config": "sweeps", "main": "sweeps", "run_decode": "sweeps", "aims": "report",
         "paired_ratio": "report"}

__all__ = ["PROMPTS", "SWEEPS", "Config", "aims", "main", "paired_ratio", "parse_args", "run_decode"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
