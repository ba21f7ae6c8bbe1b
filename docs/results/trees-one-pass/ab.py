"""passtime.py on another source of the kernel: ``python ab.py VARIANT.cpp ENGINE THREADS [REPS] [PAST]``.

The library is named by a hash of its source, so each variant compiles (once) into a library of its own; run
variants alternately (A B A B) to compare them on a machine whose speed drifts."""

import runpy
import sys
from pathlib import Path

from clover.kernels import cpu_build

cpu_build.SOURCE = Path(sys.argv[1]).resolve()
sys.argv = ["passtime.py", *sys.argv[2:]]
runpy.run_path(str(Path(__file__).with_name("passtime.py")), run_name="__main__")
