"""Median ms of one exact-int8 target pass (chain mask) at T new tokens after `past` tokens: python passtime.py ENGINE THREADS"""
import sys, time, statistics, numpy as np, torch
from pathlib import Path
from clover.export.native_target import read_native_target
from clover.kernels import cpu_target
from clover.demo import cache_root
from clover.attention import causal_packed_mask
eng, threads = Path(sys.argv[1]), int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
tensors, config = read_native_target(eng / "target_native.safetensors")
t = cpu_target.NativeTarget(tensors, config, str(cache_root() / "kernels"), threads)
L = config["num_layers"] + bool(config["augment"])
S, past = 512, int(sys.argv[4]) if len(sys.argv) > 4 else 200
kc = [torch.zeros(1, config["num_kv_heads"], S, config["head_dim"]) for _ in range(L)]
vc = [torch.zeros_like(k) for k in kc]
rng = np.random.default_rng(0)
out = {}
for T in (1, 2, 4, 8, 16, 32):
    ids = rng.integers(0, 1000, (1, T)).astype(np.int64)
    pos = (past + np.arange(T))[None].astype(np.int64)
    pl = np.array([past], np.int32)
    mask = causal_packed_mask(1, T).numpy() if hasattr(causal_packed_mask(1, T), "numpy") else causal_packed_mask(1, T)
    mask = np.ascontiguousarray(mask, np.int32)
    for _ in range(3): t.forward(ids, pos, pl, mask, kc, vc)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); t.forward(ids, pos, pl, mask, kc, vc); times.append((time.perf_counter() - t0) * 1e3)
    out[T] = (statistics.median(times), min(times), max(times))
print(" ".join(f"T={T}:{m:.2f}({lo:.2f}-{hi:.2f})" for T, (m, lo, hi) in out.items()), "| T8/T1 %.2f T16/T1 %.2f" % (out[8][0]/out[1][0], out[16][0]/out[1][0]))
