"""Building the exact int8 CPU target's library (``cpu_target.cpp``): one per kernel path, by CPU feature.

Standard library only: the wheel's build (``setup.py``) loads this file on its own to compile every path into
the package (:data:`PREBUILT`), so a machine without a C++ compiler still runs the kernel. Where the package holds
no library of this source (an editable install, a wheel built without a compiler), :func:`library` compiles it on
first use into a cache directory. docs/install.md#the-exact-int8-cpu-kernel says what each machine gets.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cpu_target.cpp"
PREBUILT = "prebuilt"  # the package's folder of libraries compiled when the wheel was built
# -ffp-contract=off: a written multiply and add stay two roundings in every instantiation (invariance)
FLAGS = ["-O3", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# kernel path -> (the CPU flags it needs beyond REQUIRED_CPU_FLAGS, its compiler flags), fastest first
KERNEL_PATHS = {
    "avx512-vnni": (("avx512f", "avx512vl", "avx512bw", "avx512_vnni"),
                    ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-DCLOVER_AVX512_VNNI"]),
    "avx-vnni": (("avx_vnni",), ["-mavxvnni", "-DCLOVER_AVX_VNNI"]),
    "avx2": ((), []),
}


class NativeUnavailable(RuntimeError):
    """The native target cannot run here; the message says why in one line."""


def find_compiler(variable: str, names: tuple[str, ...]) -> str | None:
    """``$variable`` where it names a program on the PATH, else the first of ``names`` there."""
    for name in filter(None, (os.environ.get(variable), *names)):
        if shutil.which(name):
            return name
    return None


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else g++ or c++ on the PATH."""
    return find_compiler("CXX", ("g++", "c++"))


def compile_once(cc: str, flags: list[str], source: Path, target: Path, libraries: tuple[str, ...] = ()) -> Path:
    """``source`` compiled by ``cc`` with ``flags`` into ``target``, unless it is there (staged and renamed, so
    concurrent builders do not clash); NativeUnavailable (one line) where the compiler fails."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, str(source), "-o", str(staged), *libraries], capture_output=True, text=True)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailable(f"{source.name} did not compile with {cc}: {first}")
        os.replace(staged, target)
    return target


def compile_flags(path: str) -> list[str]:
    return [*FLAGS, *KERNEL_PATHS[path][1]]


def library_name(path: str) -> str:
    """The file name of kernel path ``path``'s library of this source and these flags."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_flags(path)).encode()).hexdigest()[:16]
    return f"clover_cpu_target-{path}-{digest}.so"


def compile_library(directory: Path, path: str) -> Path:
    """Compile kernel path ``path``'s library into ``directory`` unless it is there (atomic rename: concurrent
    builders do not clash); NativeUnavailable (one line) without x86-64 or a compiler, or where it fails."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeUnavailable(f"the exact int8 CPU target needs x86-64 with AVX2 (this is {platform.machine()})")
    cxx = compiler()
    if cxx is None:
        raise NativeUnavailable("the exact int8 CPU target is compiled on first use and no C++ compiler was found "
                                "(install g++)")
    return compile_once(cxx, compile_flags(path), SOURCE, Path(directory) / library_name(path))


def prebuilt_library(path: str) -> Path | None:
    """The library the wheel shipped for ``path`` and this source, or None."""
    shipped = HERE / PREBUILT / library_name(path)
    return shipped if shipped.exists() else None


def library(cache_dir: Path, path: str) -> Path:
    """Kernel path ``path``'s library: the wheel's own, else one compiled (once) into ``cache_dir``."""
    return prebuilt_library(path) or compile_library(cache_dir, path)
