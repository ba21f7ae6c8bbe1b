"""The wheel carries the exact int8 CPU kernel compiled, one library per kernel path (clover/kernels/cpu_build.py),
so a machine without a C++ compiler still runs it; the rest of the build is pyproject.toml's.

Without x86-64 or a compiler where the wheel is built, it is built without them (one warning each), and the
kernel compiles on first use wherever a compiler is. An editable install compiles on first use too.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


def _cpu_build():
    """clover/kernels/cpu_build.py on its own (standard library only: no need to import the package here)."""
    spec = importlib.util.spec_from_file_location("clover_cpu_build", Path(__file__).parent / "clover/kernels/cpu_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        cpu_build = _cpu_build()
        out = Path(self.build_lib) / "clover" / "kernels" / cpu_build.PREBUILT
        for path in cpu_build.KERNEL_PATHS:
            try:
                print(f"compiling the exact int8 CPU kernel, {path} path", file=sys.stderr)
                cpu_build.compile_library(out, path)
            except cpu_build.NativeUnavailable as exc:
                print(f"warning: {exc}: the wheel goes without its {path} library", file=sys.stderr)


class PlatformDistribution(Distribution):
    def has_ext_modules(self):
        return True  # the wheel holds compiled libraries: tag it for this platform


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
