"""The CUDA TreeAttention kernel (clover/kernels/), its tiling model and the plugin loader (trt_plugins/).

All CPU. What runs here:
- nvcc compiles clover/kernels/tree_attention_kernel.cu for sm_80 and sm_90 (skipped without nvcc);
  the kernels' shared memory fits the 48 KB static limit;
- the kernel library's host decisions (validation, split count, workspace size)
  equal the tiling model's, for many shapes (the compiled code runs on the CPU);
- trt_plugins/tiling_model.py, a line-by-line NumPy transcription of the kernel
  (blocks, warps, 32-key tiles, mask words, online softmax, warp merge, split-K
  combine), matches clover.attention.tree_attention;
- the tiling constants in the model equal the ones in tree_attention_kernel.h;
- load_plugin_library raises a clear error when nothing is built;
- with TensorRT headers available (TRT_INCLUDE_DIR or TRT_ROOT), the plugin is
  built against a stub libnvinfer and driven through the IPluginV3 interfaces.
Nothing here runs the CUDA kernel itself: that needs a GPU
(trt_plugins/tests/run_gpu_checks.sh).
"""

from __future__ import annotations

import math
import os
import random
import re
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.attention import pack_mask, tree_attention
from trt_plugins import kernel_traffic
from trt_plugins import tiling_model as tm
from trt_plugins.loader import BUILD_HINT, ENV_VAR, PluginLibraryNotFoundError, load_plugin_library

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "trt_plugins"
KERNEL_DIR = REPO / "clover" / "kernels"  # the kernel's one copy: the package's torch op and the plugin build from it
KERNEL_CU = KERNEL_DIR / "tree_attention_kernel.cu"
KERNEL_H = KERNEL_DIR / "tree_attention_kernel.h"
NVCC = shutil.which("nvcc")
# The flags torch.utils.cpp_extension adds: the kernel must build under them too.
TORCH_EXT_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]
STATIC_SMEM_LIMIT = 48 * 1024

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")


# ------------------------------------------------------------------ nvcc
@pytest.fixture(scope="module")
def kernel_object(tmp_path_factory):
    """tree_attention_kernel.cu compiled once for sm_80 and sm_90 (PIC object, ptxas report)."""
    out_dir = tmp_path_factory.mktemp("nvcc")
    obj = out_dir / "tree_attention_kernel.o"
    cmd = [
        NVCC, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "--threads", "2", "-Xptxas", "-v",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        *TORCH_EXT_FLAGS, "-c", str(KERNEL_CU), "-o", str(obj),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return proc, obj, out_dir


@needs_nvcc
def test_nvcc_compiles_kernel_for_sm80_and_sm90(kernel_object):
    proc, obj, _ = kernel_object
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert obj.stat().st_size > 0
    report = proc.stdout + proc.stderr
    assert "error" not in report.lower()
    # 2 kernels x 3 dtypes x 2 head dims, for each architecture.
    for arch in ("sm_80", "sm_90"):
        entries = re.findall(rf"Compiling entry function '(\w+)' for '{arch}'", report)
        assert len(entries) == 12, (arch, entries)
        assert sum("treeAttentionCombineKernel" in e for e in entries) == 6
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", report)]
    assert smem and max(smem) <= STATIC_SMEM_LIMIT, smem
    registers = [int(x) for x in re.findall(r"Used (\d+) registers", report)]
    assert registers and max(registers) <= 255
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True).stdout
        assert "sm_80" in listing and "sm_90" in listing, listing


@pytest.fixture(scope="module")
def host_params_dump(kernel_object):
    proc, obj, out_dir = kernel_object
    if proc.returncode != 0:
        pytest.fail("kernel did not compile: " + proc.stderr[-2000:])
    exe = out_dir / "host_params_dump"
    link = subprocess.run(
        [NVCC, "-std=c++17", f"-I{KERNEL_DIR}", str(PLUGIN_DIR / "tests" / "host_params_dump.cpp"), str(obj),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert link.returncode == 0, link.stderr[-2000:]
    return exe


@needs_nvcc
def test_kernel_host_heuristics_match_tiling_model(host_params_dump):
    """validate / num_splits / workspace of the compiled library == the model's mirror."""
    gen = random.Random(7)
    shapes = [
        (1, 5, 9, 3, 64, 4096), (16, 33, 32, 8, 128, 4096), (1, 1, 1, 1, 64, 0), (0, 5, 4, 4, 64, 100),
        (2, 0, 4, 4, 64, 100), (1, 40, 8, 8, 128, 1), (3, 17, 12, 4, 128, 257),
    ]  # fmt: skip
    for _ in range(300):
        hq, hkv = gen.choice([(1, 1), (4, 4), (8, 2), (9, 3), (12, 4), (32, 8), (64, 8)])
        shapes.append((gen.randint(1, 64), gen.randint(1, 600), hq, hkv, gen.choice([64, 128]), gen.randint(0, 40000)))
    lines = [f"{b} {t} {hq} {hkv} {d} {s} {tm.ceil_div(t, 32)}" for b, t, hq, hkv, d, s in shapes]
    # Invalid parameters must be refused (returns cudaErrorInvalidValue == 1).
    invalid = ["1 40 6 4 64 16 2", "1 40 8 4 96 16 2", "1 40 8 4 64 16 1", "1 5 0 1 64 16 1", "-1 5 4 4 64 16 1"]
    run = subprocess.run(
        [str(host_params_dump)], input="\n".join(lines + invalid) + "\n", capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    rows = [tuple(int(x) for x in line.split()) for line in run.stdout.splitlines()]
    assert len(rows) == len(lines) + len(invalid)
    for (b, t, hq, hkv, d, s), (valid, splits, workspace, bound) in zip(shapes, rows):
        assert valid == 0
        assert splits == tm.num_splits(b, t, hq, hkv, s), (b, t, hq, hkv, d, s)
        assert workspace == tm.workspace_size(b, t, hq, hkv, s, d)
        assert bound == tm.workspace_bound(d)
        assert workspace <= bound  # the plugin reserves `bound` once for every shape
    assert all(row[0] != 0 for row in rows[len(lines) :])


def test_workspace_bound_holds_for_all_shapes():
    gen = random.Random(3)
    for _ in range(5000):
        hkv = gen.choice([1, 2, 3, 4, 8])
        hq = hkv * gen.choice([1, 2, 3, 4, 8])
        b, t, s, d = gen.randint(1, 256), gen.randint(1, 2048), gen.randint(1, 1 << 17), gen.choice([64, 128])
        n = tm.num_splits(b, t, hq, hkv, s)
        assert 1 <= n <= tm.MAX_SPLITS
        assert tm.workspace_size(b, t, hq, hkv, s, d) <= tm.workspace_bound(d)


def test_header_constants_match_tiling_model():
    text = KERNEL_H.read_text()
    found = dict(re.findall(r"constexpr int (k\w+) = (\d+);", text))
    assert {name: int(value) for name, value in found.items()} == tm.HEADER_CONSTANTS
    # The kernel must not grow private copies of the tiling constants.
    kernel = KERNEL_CU.read_text()
    assert not re.search(r"constexpr int k(BlockN|BlockM|NumWarps|TargetBlocks|MinKeysPerSplit|MaxSplits)\b", kernel)


# ------------------------------------------------------------------ tiling model vs reference
def random_tree(num_tokens: int, gen: random.Random) -> torch.Tensor:
    """bool [T, T]: a random tree (root 0); a row sees itself and its ancestors."""
    visible = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    parent = [-1] + [gen.randrange(i) for i in range(1, num_tokens)]
    for i in range(num_tokens):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parent[j]
    return visible


def make_case(batch, tokens, hq, hkv, dim, pasts, visible, slack=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_seq = max(pasts) + slack

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = randn(batch, tokens, hq, dim), randn(batch, tokens, hkv, dim), randn(batch, tokens, hkv, dim)
    k_cache, v_cache = randn(batch, hkv, max_seq, dim), randn(batch, hkv, max_seq, dim)
    past_lengths = torch.tensor(pasts, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, past_lengths, pack_mask(visible)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.is_floating_point() else t.numpy()


def run_model(case, scale=None, splits=None, poison=True, mask=None):
    """The tiling model on the case; the cache beyond past_lengths is NaN (never read)."""
    q, k, v, k_cache, v_cache, past_lengths, packed_mask = case
    kc, vc = as_np(k_cache).copy(), as_np(v_cache).copy()
    if poison:
        for b, p in enumerate(past_lengths.tolist()):
            kc[b, :, p:] = np.nan
            vc[b, :, p:] = np.nan
    packed = as_np(packed_mask if mask is None else mask)
    return tm.tree_attention_tiled(
        as_np(q), as_np(k), as_np(v), kc, vc, as_np(past_lengths), packed, scale=scale, splits=splits
    )


def reference_fp32(case, scale=None):
    """clover.attention.tree_attention on the (dtype-rounded) inputs, in fp32."""
    q, k, v, k_cache, v_cache, past_lengths, packed_mask = case
    return tree_attention(
        q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), past_lengths, packed_mask, scale=scale
    ).numpy()


def assert_close(got: np.ndarray, expected: np.ndarray, atol=2e-5, rtol=2e-5):
    assert got.shape == expected.shape
    assert np.isfinite(got).all(), "NaN/inf: the model read outside the valid range"
    np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol)


CASES = {
    # name: (batch, tokens, (Hq, Hkv), dim, pasts, mask builder)
    "two_mask_words_causal_T33": (2, 33, (4, 2), 64, [40, 0], "causal"),
    "two_mask_words_tree_T40": (2, 40, (6, 2), 64, [70, 33], "tree"),
    "bit31_only": (1, 40, (2, 2), 64, [3], "bit31"),
    "gqa_group3_smollm": (2, 5, (9, 3), 64, [100, 37], "tree"),
    "gqa_group8": (1, 9, (8, 1), 128, [65], "tree"),
    "mha_head128": (2, 6, (3, 3), 128, [31, 32], "tree"),
    "past_zero": (3, 7, (4, 2), 64, [0, 0, 0], "tree"),
    "padded_rows_empty_mask": (3, 6, (4, 2), 64, [0, 50, 0], "padded"),
    "decode_T1": (4, 1, (4, 1), 64, [300, 1, 0, 129], "tree"),
    "many_row_tiles": (1, 20, (8, 2), 64, [10], "tree"),  # 80 rows per (b, g): 5 row tiles
}


def build_mask(kind: str, batch: int, tokens: int, gen: random.Random) -> torch.Tensor:
    if kind == "causal":
        return torch.ones(tokens, tokens, dtype=torch.bool).tril()[None].repeat(batch, 1, 1)
    if kind == "bit31":
        visible = torch.zeros(batch, tokens, tokens, dtype=torch.bool)
        visible[:, :, 31] = True  # bit 31 of word 0, the int32 sign bit
        visible[:, 35, 35] = True  # one row also sees a token of word 1
        return visible
    visible = torch.stack([random_tree(tokens, gen) for _ in range(batch)])
    if kind == "padded":
        visible[0] = False  # a fully padded sequence (past 0): every row sees nothing
        visible[1, -2:] = False  # padded rows that still see the cache
        visible[2, -1] = False  # one padded row, past 0: sees nothing
    return visible


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiling_model_matches_reference(name):
    batch, tokens, (hq, hkv), dim, pasts, kind = CASES[name]
    gen = random.Random(name)
    visible = build_mask(kind, batch, tokens, gen)
    case = make_case(batch, tokens, hq, hkv, dim, pasts, visible, seed=len(name))
    expected = reference_fp32(case)
    assert_close(run_model(case), expected)
    # Rows that see nothing (empty mask row, no cache) are exactly zero, as in the reference.
    nothing = ~visible.any(-1) & (torch.tensor(pasts)[:, None] == 0)
    if kind == "padded":
        assert nothing.sum() >= tokens + 1
    assert (run_model(case)[nothing.numpy()] == 0).all()


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_tiling_model_split_k(splits):
    """Forced split counts (the launcher clamps to the workspace it gets): same result."""
    gen = random.Random(splits)
    batch, tokens, hq, hkv, dim = 2, 34, 4, 2, 64
    pasts = [200, 45]
    visible = torch.stack([random_tree(tokens, gen) for _ in range(batch)])
    case = make_case(batch, tokens, hq, hkv, dim, pasts, visible, slack=17, seed=splits)
    assert_close(run_model(case, splits=splits), reference_fp32(case))


def test_tiling_model_heuristic_splits_and_custom_scale():
    gen = random.Random(11)
    batch, tokens, hq, hkv, dim = 1, 3, 2, 1, 128
    pasts = [700]
    visible = random_tree(tokens, gen)[None]
    case = make_case(batch, tokens, hq, hkv, dim, pasts, visible, slack=100)
    assert tm.num_splits(batch, tokens, hq, hkv, max(pasts) + 100) == 4  # ceil(800 / 256)
    for scale in (None, 0.3):
        assert_close(run_model(case, scale=scale), reference_fp32(case, scale=scale))


def test_tiling_model_extra_mask_words_are_ignored():
    """W may exceed ceil(T/32) (it is only the row stride); extra words are never read."""
    gen = random.Random(5)
    visible = torch.stack([random_tree(33, gen) for _ in range(2)])
    case = make_case(2, 33, 2, 2, 64, [9, 0], visible)
    packed = case[-1]
    junk = torch.full((2, 33, 3), -1, dtype=torch.int32)
    wide = torch.cat([packed, junk], dim=-1)  # W = 5 instead of 2
    assert_close(run_model(case, mask=wide), reference_fp32(case))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiling_model_low_precision_io(dtype):
    """fp16/bf16 inputs read as fp32 (as the kernel does), output rounded once."""
    gen = random.Random(str(dtype))
    visible = torch.stack([random_tree(12, gen) for _ in range(2)])
    case = make_case(2, 12, 6, 3, 64, [90, 4], visible, dtype=dtype)
    got = torch.from_numpy(run_model(case)).to(dtype)
    q, k, v, k_cache, v_cache, past_lengths, packed_mask = case
    expected = tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask)
    assert expected.dtype == dtype
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    torch.testing.assert_close(got, expected, atol=ulp, rtol=2 * ulp)
    # In fp32, before rounding, the model agrees with the reference on the rounded inputs.
    assert_close(run_model(case), reference_fp32(case))


def test_comparison_detects_a_single_wrong_mask_bit():
    """The tolerance is tight enough that one mis-read mask bit fails the comparison."""
    gen = random.Random(1)
    visible = torch.stack([random_tree(40, gen)])
    case = make_case(1, 40, 2, 2, 64, [20], visible)
    wrong = visible.clone()
    wrong[0, 39, 31] = ~wrong[0, 39, 31]  # flip bit 31 of word 0 in the last row
    got = run_model(case, mask=pack_mask(wrong))
    with pytest.raises(AssertionError):
        assert_close(got, reference_fp32(case))


def test_warp_reductions_are_butterflies():
    x = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    total = tm.warp_sum(x)
    assert np.all(total == total[0]) and math.isclose(float(total[0]), float(x.sum(dtype=np.float64)), rel_tol=1e-5)
    y = x.copy()
    y[3] = -np.inf
    assert np.all(tm.warp_max(y) == x.max())
    assert np.all(tm.warp_max(np.full(32, -np.inf, np.float32)) == -np.inf)


# ------------------------------------------------------------------ loader
def test_loader_raises_clear_error_when_nothing_is_built(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr("trt_plugins.loader.default_library_path", lambda: tmp_path / "build" / "libnope.so")
    with pytest.raises(PluginLibraryNotFoundError) as info:
        load_plugin_library()
    message = str(info.value)
    assert "build it with: cmake -S trt_plugins -B trt_plugins/build -DTRT_ROOT=... && cmake --build trt_plugins/build" in message
    assert str(tmp_path / "build" / "libnope.so") in message
    assert isinstance(info.value, FileNotFoundError)


def test_loader_env_var_and_explicit_path(monkeypatch, tmp_path):
    missing = tmp_path / "libclover_trt_plugins.so"
    monkeypatch.setenv(ENV_VAR, str(missing))
    with pytest.raises(PluginLibraryNotFoundError, match=re.escape(ENV_VAR)) as info:
        load_plugin_library()
    assert BUILD_HINT in str(info.value)
    with pytest.raises(PluginLibraryNotFoundError, match="path argument"):
        load_plugin_library(tmp_path / "other.so")
    not_a_library = tmp_path / "fake.so"
    not_a_library.write_text("not an ELF file")
    with pytest.raises(OSError, match="could not load"):
        load_plugin_library(not_a_library)


def test_loader_default_path_is_the_cmake_build_dir():
    from trt_plugins.loader import default_library_path

    assert default_library_path() == PLUGIN_DIR / "build" / "libclover_trt_plugins.so"


# ------------------------------------------------------------------ plugin (needs TensorRT headers)
def tensorrt_include_dir() -> Path | None:
    candidates = [os.environ.get("TRT_INCLUDE_DIR")]
    if os.environ.get("TRT_ROOT"):
        candidates.append(os.path.join(os.environ["TRT_ROOT"], "include"))
    candidates.append("/usr/include/x86_64-linux-gnu")
    for candidate in candidates:
        if candidate and (Path(candidate) / "NvInferRuntime.h").is_file():
            return Path(candidate)
    return None


def cuda_toolkit_dir() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), str(Path(NVCC).resolve().parent.parent)]
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda_runtime_api.h").is_file():
            return Path(candidate)
    return None


@needs_nvcc
@pytest.mark.skipif(tensorrt_include_dir() is None, reason="TensorRT headers not found (set TRT_INCLUDE_DIR)")
def test_plugin_through_ipluginv3_interfaces(kernel_object, tmp_path):
    """Build the plugin library against a stub libnvinfer and drive it as TensorRT does."""
    proc, obj, _ = kernel_object
    assert proc.returncode == 0
    include = tensorrt_include_dir()
    cuda_home = cuda_toolkit_dir()
    if cuda_home is None:
        pytest.skip("CUDA toolkit headers (cuda_runtime_api.h) not found; set CUDA_HOME")
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler"
    stub = tmp_path / "stub_nvinfer.cpp"
    stub.write_text(
        "namespace nvinfer1 { class IPluginRegistry; }\n"
        'extern "C" nvinfer1::IPluginRegistry* getPluginRegistry() noexcept { return nullptr; }\n'
    )
    common = ["-std=c++17", f"-I{PLUGIN_DIR}", f"-I{KERNEL_DIR}", "-isystem", str(include),
              "-isystem", str(cuda_home / "include")]
    steps = [
        [cxx, "-shared", "-fPIC", str(stub), "-o", str(tmp_path / "libnvinfer.so")],
        [cxx, *common, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
         str(PLUGIN_DIR / "tree_attention_plugin.cpp"), str(obj), f"-L{tmp_path}", "-lnvinfer",
         f"-L{cuda_home / 'lib64'}", "-lcudart", "-Wl,--no-undefined", "-o", str(tmp_path / "libclover_trt_plugins.so")],
        [cxx, *common, "-O0", str(PLUGIN_DIR / "tests" / "plugin_host_check.cpp"), "-ldl",
         "-o", str(tmp_path / "plugin_host_check")],
    ]  # fmt: skip
    for cmd in steps:
        build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert build.returncode == 0, build.stderr[-4000:]
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{cuda_home / 'lib64'}")
    run = subprocess.run(
        [str(tmp_path / "plugin_host_check"), str(tmp_path / "libclover_trt_plugins.so")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ALL PASSED" in run.stdout


@pytest.mark.parametrize("batch, tokens, hq, hkv, pasts, splits", [
    (1, 1, 4, 1, [300], None),        # decode: one row tile, heuristic splits
    (2, 20, 8, 2, [70, 0], None),     # 80 rows per (b, g): 5 row tiles, each reading the cache again
    (3, 16, 12, 4, [33, 5, 64], 3),   # 48 rows: 3 row tiles x 3 forced splits
    (1, 33, 4, 4, [129], 2),          # 33 rows: 3 tiles, a tile of one row
])
def test_cache_keys_read_counts_what_the_model_reads(batch, tokens, hq, hkv, pasts, splits):
    """tm.cache_keys_read (the bandwidth the GPU check reports) against the keys the kernel's blocks read."""
    gen = random.Random(tokens)
    visible = torch.stack([random_tree(tokens, gen) for _ in range(batch)])
    case = make_case(batch, tokens, hq, hkv, 64, pasts, visible, slack=7)
    q, k, v, k_cache, v_cache, past_lengths, packed_mask = case
    stats = {}
    tm.tree_attention_tiled(as_np(q), as_np(k), as_np(v), as_np(k_cache), as_np(v_cache), as_np(past_lengths),
                            as_np(packed_mask), splits=splits, stats=stats)
    assert stats["cache_keys_read"] == tm.cache_keys_read(tokens, hq, hkv, pasts, k_cache.shape[2])


def test_kernel_traffic_rates_by_hand(tmp_path, capsys):
    """2 sequences x 1 KV head x 1,000 positions x (K + V) x 128 dims x 2 bytes = 1.024 MB; T 17 with one query
    head per KV head is 17 rows, two row tiles, so the kernel reads it twice; in a microsecond: 2.048 / 1.024 TB/s."""
    row = {"B": 2, "T": 17, "past": 1000, "Hq/Hkv": "1/1", "D": 128, "tree_attn_ms": 0.001, "sdpa_mask_ms": 0.001,
           "tree_attn_T1_ms": 0.002, "sdpa_T1_ms": 0.004}
    got = kernel_traffic.traffic(row)
    assert got["row_tiles"] == 2 and got["cache_MB"] == 1.0 and got["kernel_MB_read"] == 2.0
    assert (got["kernel_TBps"], got["sdpa_TBps"], got["kernel_T1_TBps"], got["sdpa_T1_TBps"]) == \
        (2.048, 1.024, 0.512, 0.256)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"steps": [{"name": "kernel_correctness", "data": {"timing": [row]}}]}))
    assert kernel_traffic.main([str(report)]) == 0
    assert "2.05 TB/s" in capsys.readouterr().out
    report.write_text(json.dumps({"steps": [{"name": "kernel_build", "data": {}}]}))
    with pytest.raises(SystemExit):
        kernel_traffic.main([str(report)])
    assert "no op-level timings" in capsys.readouterr().err
