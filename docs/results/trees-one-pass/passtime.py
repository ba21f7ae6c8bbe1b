"""One exact-int8 target pass against its new tokens T, outside the decode loop:
``python passtime.py ENGINE THREADS [REPS] [PAST]`` prints, for T = 1, 2, 4, 8, 16, 32 (a chain after PAST cached
positions, batch 1), the median (min-max) ms of REPS passes after 3 untimed ones, and T = 8 and 16 over T = 1."""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from clover.attention import causal_packed_mask
from clover.demo import cache_root
from clover.export.native_target import read_native_target
from clover.kernels import cpu_target

engine, threads = Path(sys.argv[1]), int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
past = int(sys.argv[4]) if len(sys.argv) > 4 else 200
tensors, config = read_native_target(engine / "target_native.safetensors")
target = cpu_target.NativeTarget(tensors, config, str(cache_root() / "kernels"), threads)
layers = config["num_layers"] + bool(config["augment"])
k_cache = [torch.zeros(1, config["num_kv_heads"], 512, config["head_dim"]) for _ in range(layers)]
v_cache = [torch.zeros_like(k) for k in k_cache]
rng = np.random.default_rng(0)
medians = {}
for tokens in (1, 2, 4, 8, 16, 32):
    ids = rng.integers(0, 1000, (1, tokens)).astype(np.int64)
    positions = (past + np.arange(tokens))[None].astype(np.int64)
    lengths = np.array([past], np.int32)
    mask = np.ascontiguousarray(causal_packed_mask(1, tokens).numpy(), np.int32)
    for _ in range(3):
        target.forward(ids, positions, lengths, mask, k_cache, v_cache)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        target.forward(ids, positions, lengths, mask, k_cache, v_cache)
        times.append((time.perf_counter() - start) * 1e3)
    medians[tokens] = statistics.median(times)
    print(f"T={tokens}:{medians[tokens]:.2f}({min(times):.2f}-{max(times):.2f})", end=" ")
print(f"| T8/T1 {medians[8] / medians[1]:.2f} T16/T1 {medians[16] / medians[1]:.2f}")
