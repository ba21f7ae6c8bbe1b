"""Arguments a program gets without their being on its command line (issue 62).

tritonserver 2.51 takes the admin key only as an argument (``--http-restricted-api=APIS:clover-admin-key=KEY``;
no option file, no environment variable), and a command line is public: ``ps`` and ``/proc/PID/cmdline`` show
it to every local user. ``hidden_args.c``, compiled on first use with the system's C compiler into the cache and
preloaded into tritonserver, wraps glibc's ``__libc_start_main``: main gets the visible arguments followed by
one per line of a private file (mode 0600, in a 0700 directory), which the library removes once read, while the
kernel's copy of the command line stays as it was. The file's removal is the proof that the arguments were taken.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from clover.kernels.cpu_build import NativeUnavailable, compile_once, find_compiler

SOURCE = Path(__file__).resolve().parent / "hidden_args.c"
FLAGS = ["-O2", "-shared", "-fPIC"]
FILE_ENV = "CLOVER_HIDDEN_ARGS_FILE"
PRELOAD_BEFORE_ENV = "CLOVER_HIDDEN_ARGS_PRELOAD"
ELF_MAGIC = b"\x7fELF"


class HiddenArgsUnavailable(RuntimeError):
    """The arguments cannot be hidden here; the message says why in one line."""


def compiler() -> str | None:
    """The C compiler: ``$CC``, else cc or gcc on the PATH."""
    return find_compiler("CC", ("cc", "gcc"))


def unavailable_reason(binary: Path) -> str | None:
    """None where arguments can be hidden from ``binary``'s command line, else why not (one line)."""
    if platform.system() != "Linux":
        return f"hiding arguments needs Linux's glibc (this is {platform.system()})"
    try:
        with open(binary, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"cannot read {binary}: {exc.strerror}"
    if magic != ELF_MAGIC:  # a script would hand the arguments on, visibly, to the program it runs
        return f"{binary} is not a compiled program (a script?)"
    if compiler() is None:
        return "hiding arguments needs a C compiler, and none was found (install gcc)"
    return None


def build_library(build_dir: Path) -> Path:
    """Compile the library once into ``build_dir`` (one file per source, flags and compiler; atomic rename)."""
    cc = compiler()
    if cc is None:
        raise HiddenArgsUnavailable("hiding arguments needs a C compiler, and none was found (install gcc)")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    try:
        return compile_once(cc, FLAGS, SOURCE, Path(build_dir) / f"clover_hidden_args-{digest}.so", ("-ldl",))
    except NativeUnavailable as exc:
        raise HiddenArgsUnavailable(str(exc)) from None


def hide(args: list[str], directory: Path, env: dict[str, str], library: Path) -> Path:
    """Write ``args`` to a private file in ``directory`` and set ``env`` (the program's environment) to preload
    ``library``, which passes them on; returns the file, which is gone once the program has read it."""
    if any("\n" in arg for arg in args):
        raise HiddenArgsUnavailable("an argument to hide holds a line break (one argument per line)")
    path = Path(directory) / "hidden-args"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{arg}\n" for arg in args))
    env[PRELOAD_BEFORE_ENV] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = os.pathsep.join(filter(None, [str(library), env.get("LD_PRELOAD")]))
    env[FILE_ENV] = str(path)
    return path
