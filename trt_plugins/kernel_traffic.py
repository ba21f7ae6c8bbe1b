"""How fast the TreeAttention kernel and SDPA stream the KV cache, from the GPU check's op-level timings.

Each of the check's timing rows (``kernel_correctness``'s ``data.timing`` in a ``gpu_check`` report, or
``trt_plugins/tests/gpu_checks.py``) names a shape and the median milliseconds of the kernel and of SDPA. The
bytes each one must read are a function of the shape: SDPA reads the cache once; the kernel reads it once per
row tile (:func:`trt_plugins.tiling_model.cache_keys_read`). Dividing gives the rate each one reached, which is
what docs/gpu-engine.md#why-the-kernel-is-slow-at-large-shapes reads from the 2026-12-04 run::

    python -m trt_plugins.kernel_traffic docs/results/gpu/2026-12-04-h200/report.json

A model of the reads, not a profile: it leaves out the new tokens' K/V and the queries (small beside a cache of
1,024+ positions) and counts bytes as the cache's dtype (fp16 in the check).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trt_plugins import tiling_model

CACHE_ITEMSIZE = 2  # the check times fp16


def traffic(row: dict, itemsize: int = CACHE_ITEMSIZE) -> dict:
    """The reads and rates of one timing row (keys ``B, T, past, Hq/Hkv, D`` and the ``*_ms`` medians)."""
    hq, hkv = (int(x) for x in str(row["Hq/Hkv"]).split("/"))
    batch, tokens, past, dim = row["B"], row["T"], row["past"], row["D"]
    key_bytes = 2 * dim * itemsize  # one K row and one V row

    def kernel_bytes(num_tokens: int) -> int:
        return tiling_model.cache_keys_read(num_tokens, hq, hkv, [past] * batch, past) * key_bytes

    once = batch * hkv * past * key_bytes
    out = {"row_tiles": tiling_model.row_tiles(tokens, hq // hkv),
           "kernel_MB_read": round(kernel_bytes(tokens) / 1e6, 1), "cache_MB": round(once / 1e6, 1)}
    for name, ms, read in (("kernel_TBps", row.get("tree_attn_ms"), kernel_bytes(tokens)),
                           ("sdpa_TBps", row.get("sdpa_mask_ms"), once),
                           ("kernel_T1_TBps", row.get("tree_attn_T1_ms"), kernel_bytes(1)),
                           ("sdpa_T1_TBps", row.get("sdpa_T1_ms"), once)):
        out[name] = round(read / (ms * 1e-3) / 1e12, 3) if ms else None
    return out


def timing_rows(report: dict) -> list[dict]:
    """The op-level timing rows of a gpu_check report.json (empty when the kernel step did not run)."""
    for step in report.get("steps", []):
        if step.get("name") == "kernel_correctness":
            return step.get("data", {}).get("timing", [])
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Prints one line per timed shape: the bytes each way reads and the "
                                            "TB/s it reached (bytes / median time).")
    parser.add_argument("report", type=Path, help="a gpu_check report.json (scripts/gpu_check.sh --out DIR)")
    args = parser.parse_args(argv)
    rows = timing_rows(json.loads(args.report.read_text()))
    if not rows:
        parser.error(f"{args.report} has no op-level timings (its kernel_correctness step did not run)")
    for row in rows:
        t = traffic(row)
        print(f"B {row['B']:>2} T {row['T']:>2} past {row['past']:>4} {row['Hq/Hkv']:>4} D {row['D']:>3} | "
              f"row tiles {t['row_tiles']} | kernel reads {t['kernel_MB_read']:>6} MB in {row['tree_attn_ms']:.3f} ms"
              f" = {t['kernel_TBps']:.2f} TB/s (T 1: {t['kernel_T1_TBps']:.2f}) | SDPA reads {t['cache_MB']:>5} MB"
              f" in {row['sdpa_mask_ms']:.3f} ms = {t['sdpa_TBps']:.2f} TB/s (T 1: {t['sdpa_T1_TBps']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
