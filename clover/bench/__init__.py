"""Measurement, outside the decode core: ``python -m clover.bench`` and the peer runtimes it compares against.

- :mod:`clover.bench.sweeps`: the benchmark command: the configurations, interleaved sweeps, the measurements.
- :mod:`clover.bench.samples`: the samples on disk, so a killed run resumes.
- :mod:`clover.bench.report`: medians and ranges, the aims as paired ratios, ``bench.md`` and the PNGs.
- :mod:`clover.bench.genai`: onnxruntime-genai and its model builder's graph (the ``peers`` and ``passes`` sweeps).
- :mod:`clover.bench.llamacpp`: llama.cpp on the demo GGUF (the ``llamacpp`` and ``peers`` sweeps).

The product (clover/ outside this package) never imports it.
"""

from clover.bench.report import aims, paired_ratio
from clover.bench.sweeps import PROMPTS, SWEEPS, Config, main, parse_args, run_decode

__all__ = ["PROMPTS", "SWEEPS", "Config", "aims", "main", "paired_ratio", "parse_args", "run_decode"]
