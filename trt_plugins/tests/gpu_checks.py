"""GPU checks of the TreeAttention CUDA kernel (one GPU, well under 5 minutes).

Run through ``bash trt_plugins/tests/run_gpu_checks.sh`` (or directly with
``python3 trt_plugins/tests/gpu_checks.py`` from anywhere). Steps:

1. JIT-build the kernel as a PyTorch CUDA extension (``clover/kernels``).
2. Correctness: compare with ``clover.attention.tree_attention`` on random shapes
   (B 1-16, T 1-64 so one or two mask words, mixed past lengths 0-4096 in a batch, GQA,
   fp32/fp16/bf16, head dim 64 and 128),
   plus fixed edge cases (bit 31 / two mask words, padded rows that see nothing,
   past 0, decode T=1, a long causal prompt chunk, a custom scale). The cache
   beyond past_lengths is filled with NaN for the kernel, so any read past the
   valid range shows up as NaN.
3. Timing: the kernel vs ``F.scaled_dot_product_attention`` with an explicit
   boolean mask over the concatenated (cache + new) keys, and vs SDPA at T=1, with
   the rate each one read the cache at (trt_plugins/kernel_traffic.py).

Exit status 0 only if every correctness case passes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from clover.attention import pack_mask, tree_attention  # noqa: E402
from clover.kernels import load_extension  # noqa: E402
from trt_plugins.kernel_traffic import traffic  # noqa: E402

# (atol, rtol) on the output in the I/O dtype. The reference also computes in fp32
# and rounds once, so the outputs may differ by about one unit in the last place.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 4e-3),  # fp16 ulp <= 2^-10 relative
    torch.bfloat16: (1.6e-2, 1.6e-2),  # bf16 ulp <= 2^-7 relative
}
HEAD_CONFIGS = [(1, 1), (4, 4), (8, 2), (9, 3), (12, 4), (16, 1), (32, 8)]


def random_tree_visible(batch: int, num_tokens: int, gen: random.Random) -> torch.Tensor:
    """bool [B, T, T]: random trees (token 0 the root; a row sees itself and its ancestors)."""
    visible = torch.zeros(batch, num_tokens, num_tokens, dtype=torch.bool)
    for b in range(batch):
        parent = [-1] + [gen.randrange(i) for i in range(1, num_tokens)]
        real = gen.randint(1, num_tokens) if gen.random() < 0.3 else num_tokens  # trailing padded rows
        for i in range(real):
            j = i
            while j >= 0:
                visible[b, i, j] = True
                j = parent[j]
    return visible


def make_inputs(batch, num_tokens, num_q_heads, num_kv_heads, head_dim, pasts, slack, dtype, visible, device):
    gen = torch.Generator(device=device).manual_seed(batch * 1000 + num_tokens)
    max_seq = max(pasts) + slack
    shape_q = (batch, num_tokens, num_q_heads, head_dim)
    shape_kv = (batch, num_tokens, num_kv_heads, head_dim)
    shape_cache = (batch, num_kv_heads, max_seq, head_dim)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    q, k, v = randn(shape_q), randn(shape_kv), randn(shape_kv)
    k_cache, v_cache = randn(shape_cache), randn(shape_cache)
    past_lengths = torch.tensor(pasts, dtype=torch.int32, device=device)
    packed_mask = pack_mask(visible).to(device)
    return q, k, v, k_cache, v_cache, past_lengths, packed_mask


def poisoned(cache: torch.Tensor, pasts: list[int]) -> torch.Tensor:
    """A copy of the cache with NaN at every position >= past_lengths[b]."""
    out = cache.clone()
    for b, p in enumerate(pasts):
        out[b, :, p:] = float("nan")
    return out


def check_case(ext, name, batch, num_tokens, heads, head_dim, pasts, dtype, visible, device, scale=None, slack=0):
    num_q_heads, num_kv_heads = heads
    inputs = make_inputs(batch, num_tokens, num_q_heads, num_kv_heads, head_dim, pasts, slack, dtype, visible, device)
    q, k, v, k_cache, v_cache, past_lengths, packed_mask = inputs
    expected = tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale=scale)
    got = ext.tree_attention(
        q, k, v, poisoned(k_cache, pasts), poisoned(v_cache, pasts), past_lengths, packed_mask,
        0.0 if scale is None else scale,
    )
    torch.cuda.synchronize()
    atol, rtol = TOLERANCES[dtype]
    err = (got.float() - expected.float()).abs()
    bound = atol + rtol * expected.float().abs()
    finite = bool(torch.isfinite(got.float()).all())
    ok = finite and bool((err <= bound).all())
    # Rows that see nothing (empty mask row and no cache) must be exactly zero.
    sees_nothing = (~visible.to(device).any(-1)) & (past_lengths[:, None] == 0)  # [B, T]
    if sees_nothing.any():
        ok = ok and bool((got[sees_nothing] == 0).all())
    splits = ext.num_splits(q, k, v, k_cache, v_cache, past_lengths, packed_mask)
    return {
        "name": name,
        "B": batch,
        "T": num_tokens,
        "Hq/Hkv": f"{num_q_heads}/{num_kv_heads}",
        "D": head_dim,
        "max_past": max(pasts),
        "dtype": str(dtype).replace("torch.", ""),
        "splits": splits,
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        "finite": finite,
        "ok": ok,
    }


def correctness(ext, device, num_random: int, seed: int, max_tokens: int = 64) -> list[dict]:
    """Fixed edge cases, then ``num_random`` random shapes with 1 to ``max_tokens`` tokens in flight."""
    gen = random.Random(seed)
    results = []
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    # Fixed edge cases.
    causal33 = torch.ones(33, 33, dtype=torch.bool).tril()[None].expand(2, -1, -1).clone()
    only31 = torch.zeros(1, 40, 40, dtype=torch.bool)
    only31[0, :, 31] = True  # every row sees exactly token 31 (bit 31 = the int32 sign bit)
    empty = torch.zeros(3, 7, 7, dtype=torch.bool)
    empty[0] = torch.eye(7, dtype=torch.bool)
    chunk = torch.ones(256, 256, dtype=torch.bool).tril()[None]
    fixed = [
        ("causal T=33 (bit 31, word 1)", 2, 33, (8, 2), 128, [0, 100], torch.float16, causal33, None),
        ("only bit 31, T=40", 1, 40, (4, 4), 64, [5], torch.float32, only31, None),
        ("padded rows see nothing", 3, 7, (9, 3), 64, [0, 0, 0], torch.bfloat16, empty, None),
        ("decode T=1, past 4096", 4, 1, (32, 8), 128, [4096, 1, 0, 4095], torch.float16,
         torch.ones(4, 1, 1, dtype=torch.bool), None),
        ("prompt chunk T=256 causal", 1, 256, (9, 3), 64, [1000], torch.float16, chunk, None),
        ("custom scale 0.3", 2, 5, (12, 4), 128, [300, 7], torch.float32, random_tree_visible(2, 5, gen), 0.3),
    ]
    for name, batch, tokens, heads, dim, pasts, dtype, visible, scale in fixed:
        results.append(check_case(ext, name, batch, tokens, heads, dim, pasts, dtype, visible, device, scale, slack=3))
    # Random shapes.
    for i in range(num_random):
        batch = gen.randint(1, 16)
        tokens = gen.randint(1, max_tokens)
        heads = gen.choice(HEAD_CONFIGS)
        dim = gen.choice([64, 128])
        dtype = dtypes[i % 3]
        max_past = gen.choice([0, gen.randint(1, 64), gen.randint(1, 4096), 4096])
        pasts = [gen.randint(0, max_past) for _ in range(batch)]
        pasts[0] = max_past
        visible = random_tree_visible(batch, tokens, gen)
        results.append(
            check_case(ext, f"random {i}", batch, tokens, heads, dim, pasts, dtype, visible, device,
                       slack=gen.randint(0, 64))
        )
    return results


def time_ms(fn, warmup: int = 5, iters: int = 25) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def sdpa_gqa(q, k, v, mask):
    """SDPA with GQA; q [B,Hq,T,D], k/v [B,Hkv,L,D], mask bool [B,1,T,L] or None."""
    if q.shape[1] != k.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        except TypeError:  # torch < 2.5
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# (B, T, past, Hq, Hkv, D): SmolLM2-135M-like and Llama-8B-like attention shapes.
BENCH_CONFIGS = [
    (1, 5, 1024, 9, 3, 64),
    (1, 5, 4096, 32, 8, 128),
    (8, 5, 2048, 32, 8, 128),
    (16, 16, 4096, 32, 8, 128),
    (16, 32, 1024, 9, 3, 64),
    (4, 33, 4096, 32, 8, 128),
]


def benchmark(ext, device, dtype=torch.float16) -> list[dict]:
    rows = []
    gen = random.Random(0)
    for batch, tokens, past, hq, hkv, dim in BENCH_CONFIGS:
        visible = random_tree_visible(batch, tokens, gen)
        pasts = [past] * batch
        q, k, v, kc, vc, pl, pm = make_inputs(batch, tokens, hq, hkv, dim, pasts, 0, dtype, visible, device)
        ours = time_ms(lambda: ext.tree_attention(q, k, v, kc, vc, pl, pm, 0.0))

        # SDPA over the concatenated keys with an explicit [B, 1, T, past + T] mask.
        qs = q.transpose(1, 2).contiguous()
        keys = torch.cat([kc[:, :, :past], k.transpose(1, 2)], dim=2).contiguous()
        values = torch.cat([vc[:, :, :past], v.transpose(1, 2)], dim=2).contiguous()
        mask = torch.cat(
            [torch.ones(batch, tokens, past, dtype=torch.bool, device=device), visible.to(device)], dim=-1
        )[:, None]
        sdpa = time_ms(lambda: sdpa_gqa(qs, keys, values, mask))
        # Cross-check: SDPA is an independent implementation of the same maths.
        sdpa_diff = float(
            (sdpa_gqa(qs, keys, values, mask).transpose(1, 2).float()
             - ext.tree_attention(q, k, v, kc, vc, pl, pm, 0.0).float()).abs().max()
        )

        def sdpa_with_concat():
            kk = torch.cat([kc[:, :, :past], k.transpose(1, 2)], dim=2)
            vv = torch.cat([vc[:, :, :past], v.transpose(1, 2)], dim=2)
            return sdpa_gqa(q.transpose(1, 2), kk, vv, mask)

        sdpa_cat = time_ms(sdpa_with_concat)

        # The same at T = 1 (plain decoding step: one query over past + 1 keys, no mask).
        q1, k1, v1 = q[:, :1].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous()
        pm1 = torch.ones(batch, 1, 1, dtype=torch.int32, device=device)
        ours_t1 = time_ms(lambda: ext.tree_attention(q1, k1, v1, kc, vc, pl, pm1, 0.0))
        keys1, values1 = keys[:, :, : past + 1].contiguous(), values[:, :, : past + 1].contiguous()
        q1s = q1.transpose(1, 2).contiguous()
        sdpa_t1 = time_ms(lambda: sdpa_gqa(q1s, keys1, values1, None))
        row = {
            "B": batch, "T": tokens, "past": past, "Hq/Hkv": f"{hq}/{hkv}", "D": dim,
            "splits": ext.num_splits(q, k, v, kc, vc, pl, pm),
            "tree_attn_ms": ours, "sdpa_mask_ms": sdpa, "sdpa_mask_concat_ms": sdpa_cat,
            "tree_attn_T1_ms": ours_t1, "sdpa_T1_ms": sdpa_t1, "max_diff_vs_sdpa": sdpa_diff,
        }
        rows.append(row | traffic(row, itemsize=torch.tensor([], dtype=dtype).element_size()))
    return rows


def print_table(rows: list[dict], columns: list[str]) -> None:
    def fmt(x):
        return f"{x:.4f}" if isinstance(x, float) else str(x)

    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r[c]).rjust(w) for c, w in zip(columns, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-cases", type=int, default=36)
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens in flight in a random case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--build-dir", default="/tmp/clover_tree_attention_ext")
    parser.add_argument("--json", help="write all results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing checked")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # keep the fp32 reference in true fp32
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}", flush=True)

    t0 = time.time()
    ext = load_extension(verbose=False, build_directory=args.build_dir)
    print(f"extension built/loaded in {time.time() - t0:.1f} s", flush=True)

    t0 = time.time()
    results = correctness(ext, device, args.random_cases, args.seed, args.max_tokens)
    print(f"\ncorrectness vs clover.attention.tree_attention ({time.time() - t0:.1f} s):")
    print_table(results, ["name", "B", "T", "Hq/Hkv", "D", "max_past", "dtype", "splits", "max_abs_err", "ok"])
    failures = [r for r in results if not r["ok"]]

    bench = []
    if not args.skip_bench:
        t0 = time.time()
        bench = benchmark(ext, device)
        print(f"\ntiming, fp16, median ms ({time.time() - t0:.1f} s):")
        print_table(bench, ["B", "T", "past", "Hq/Hkv", "D", "splits", "tree_attn_ms", "sdpa_mask_ms",
                            "sdpa_mask_concat_ms", "tree_attn_T1_ms", "sdpa_T1_ms", "max_diff_vs_sdpa",
                            "row_tiles", "kernel_TBps", "sdpa_TBps", "kernel_T1_TBps", "sdpa_T1_TBps"])
        bad = [r for r in bench if not r["max_diff_vs_sdpa"] <= 1e-2]
        if bad:
            print(f"WARNING: kernel and SDPA disagree by more than 1e-2 (fp16) on {len(bad)} timing configs")
    if args.json:
        Path(args.json).write_text(json.dumps({"correctness": results, "timing": bench}, indent=1))
    if failures:
        print(f"\nFAILED: {len(failures)} of {len(results)} correctness cases: {[r['name'] for r in failures]}")
        return 1
    print(f"\nALL {len(results)} CORRECTNESS CASES PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
