"""Target-pass time of engines at 1 and 8 new tokens, interleaved (docs/results/quantized-target).

    python benchmarks/quantized_pass.py qt-fp32 qt-q4-fp32 qt-q4-int8 qt-int8-int8   # engines/<name>

Batch 1, 100 cached positions, 2 onnxruntime threads; median (min-max) of 7 rounds of 10 passes, in ms.
"""
import sys, time, torch, numpy as np
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.attention import causal_packed_mask
names = sys.argv[1:]
engines = {n: OnnxRuntimeEngine(f"engines/{n}", threads=2) for n in names}
def inputs(spec, T, past=100):
    ids = torch.randint(0, 1000, (1, T)); pos = torch.arange(past, past + T)[None]
    pl = torch.tensor([past], dtype=torch.int32); mask = causal_packed_mask(1, T)
    kc = [torch.randn(1, spec.num_kv_heads, 512, spec.head_dim) for _ in range(spec.num_kv_layers)]
    return ids, pos, pl, mask, kc, [k.clone() for k in kc]
for T in (1, 8):
    res = {n: [] for n in names}
    ins = {n: inputs(e.spec, T) for n, e in engines.items()}
    for r in range(7):
        for n, e in engines.items():
            e.target(*ins[n])
            t = time.perf_counter()
            for _ in range(10): e.target(*ins[n])
            res[n].append((time.perf_counter() - t) / 10 * 1000)
    print("T", T, {n: f"{np.median(v):.2f}ms ({min(v):.2f}-{max(v):.2f})" for n, v in res.items()}, flush=True)
