"""The wheel is the product: built from this checkout, installed into a fresh venv outside it, and run from a
directory that is not the checkout, it builds, generates and serves (Triton and the OpenAI endpoint) on its own.

The venv reuses this interpreter's installed dependencies (torch, transformers, onnxruntime, Triton, the demo
model: a ``.pth`` line, so they are found but nothing of this checkout is) and gets the wheel with ``--no-deps``.
Engines go to the default home of an installed package, ``$XDG_CACHE_HOME/clover`` (a temporary one here); the
converted demo checkpoint is reused from this machine's cache (``$CLOVER_CACHE_DIR``) to save a minute.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 1 min on 2 cores (56 s, 2026-12-04): a wheel, a venv, a demo engine, two servers

ROOT = Path(__file__).resolve().parents[1]
WHEEL_SOURCES = ("pyproject.toml", "setup.py", "README.md", "clover", "trt_plugins")  # what setuptools reads to build it
# what a user needs without a checkout, beside the modules: the Triton template, the build's entry point, the
# kernel sources the GPU path compiles, the shipped heads
PACKAGE_DATA = ("clover/serving/triton_template/model.py", "clover/export/__main__.py",
                "clover/kernels/tree_attention_kernel.cu", "clover/kernels/tree_attention_kernel.h",
                "clover/kernels/tree_attention_ext.cpp", "clover/kernels/cpu_target.cpp", "clover/serving/hidden_args.c",
                "trt_plugins/CMakeLists.txt", "trt_plugins/tree_attention_plugin.cpp",
                "clover/assets/smollm2-135m-instruct/clover/config.json")
COMMAND_S = 600
NEW_TOKENS = 8


def _run(args, env, cwd, timeout=COMMAND_S) -> subprocess.CompletedProcess:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    command = " ".join(map(str, args))
    assert done.returncode == 0, f"{command} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _build_wheel(dest: Path) -> Path:
    """The wheel of a copy of the sources (setuptools' build/ and egg-info stay out of the checkout), built offline
    with this interpreter's setuptools."""
    source = dest / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "build"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dest / "dist"),
          str(source)], os.environ, dest)
    return next((dest / "dist").glob("clover_decoding-*.whl"))


def _this_interpreters_packages() -> list[str]:
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(p for p in paths if Path(p).is_dir() and Path(p) != ROOT))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, environment, working directory outside the checkout) with the wheel installed."""
    from clover.demo import DemoModelMissing, cache_root, find_demo_gguf

    try:
        find_demo_gguf()
    except DemoModelMissing as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _build_wheel(tmp)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [name for name in PACKAGE_DATA if name not in names], "package data missing from the wheel"
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], os.environ, tmp)
    purelib = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        os.environ, tmp).stdout.strip())
    # found after the venv's own site-packages, and not a site directory: its .pth files (an editable clover) stay out
    (purelib / "clover_test_dependencies.pth").write_text("\n".join(_this_interpreters_packages()) + "\n")
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", str(wheel)], os.environ, tmp)
    user = tmp / "user"
    user.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "CLOVER_HOME", "CLOVER_ENGINE_DIR", "VIRTUAL_ENV")}
    env.update(PATH=os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]), XDG_CACHE_HOME=str(tmp / "cache"),
               CLOVER_CACHE_DIR=str(cache_root()), TMPDIR=str(tmp))
    return venv / "bin", env, user, purelib


def test_the_installed_package_runs_from_the_venv(installed):
    bin_dir, env, user, purelib = installed
    where = _run([bin_dir / "python", "-c", "import clover; print(clover.__file__)"], env, user).stdout.strip()
    assert Path(where) == purelib / "clover" / "__init__.py"
    assert _run([bin_dir / "clover", "--version"], env, user).stdout.strip() == f"clover {version('clover-decoding')}"
    assert _run([bin_dir / "python", "-m", "clover.export", "--help"], env, user).stdout.startswith(
        "usage: python -m clover.export")
    # the GPU path compiles the tree-attention kernel from these on first use (clover/kernels)
    sources = _run([bin_dir / "python", "-c", "import clover.kernels as ext; print(*ext.SOURCES, sep='\\n')"],
                   env, user).stdout.split()
    assert sources and all(Path(path).is_file() and Path(path).is_relative_to(purelib) for path in sources), sources


def test_the_wheel_runs_the_exact_int8_kernel_without_a_compiler(installed):
    """The wheel ships the CPU kernel compiled, one library per kernel path: with no C++ compiler on the PATH the
    installed package loads the library of this CPU's path from the package, compiling nothing."""
    from clover.kernels import cpu_build, cpu_target

    if cpu_target.unavailable_reason():
        pytest.skip(cpu_target.unavailable_reason())
    bin_dir, env, user, purelib = installed
    shipped = sorted(p.name for p in (purelib / "clover" / "kernels" / cpu_build.PREBUILT).glob("*.so"))
    assert shipped == sorted(cpu_build.library_name(path) for path in cpu_build.KERNEL_PATHS), shipped
    no_compiler = {**env, "PATH": str(bin_dir)}
    no_compiler.pop("CXX", None)
    code = ("from clover.kernels import cpu_target as t; import tempfile; "
            "print(t.compiler(), t.unavailable_reason(), t.load_library(tempfile.mkdtemp(), t.kernel_path())._name)")
    said = _run([bin_dir / "python", "-c", code], no_compiler, user).stdout.split()
    assert said[:2] == ["None", "None"] and Path(said[2]).parent == purelib / "clover" / "kernels" / cpu_build.PREBUILT


@pytest.fixture(scope="module")
def engine(installed) -> Path:
    """``clover build`` into the default engine directory of an installed package (small limits: a quick build);
    with its default calibration, so that clover generate and clover serve --demo take it as the demo engine."""
    bin_dir, env, user, purelib = installed
    engine_dir = Path(env["XDG_CACHE_HOME"]) / "clover" / "engines" / "demo"
    _run([bin_dir / "clover", "build", "--target", "demo", "--output", str(engine_dir), "--max-batch", "4",
          "--max-seq", "512", "--calibrate-max-tokens", "16"], env, user)
    assert (engine_dir / "engine.json").is_file()
    return engine_dir


def test_the_wheel_builds_and_generates_outside_the_checkout(installed, engine):
    bin_dir, env, user, purelib = installed
    prompt = ["--prompt", "Name three fruits.", "--max-new-tokens", str(NEW_TOKENS)]
    given = _run([bin_dir / "clover", "generate", "--engine", str(engine), *prompt, "--no-compare"], env, user)
    assert given.stdout.strip() and "tok/s" in given.stderr
    default = _run([bin_dir / "clover", "generate", *prompt, "--no-compare"], env, user)  # the default engine
    assert "building the demo engine" not in default.stdout + default.stderr and default.stdout == given.stdout
    assert not (purelib / "engines").exists() and not (user / "engines").exists()


def test_the_wheel_serves_the_demo_through_triton(installed, engine):
    _skip_without_triton()
    bin_dir, env, user, purelib = installed
    demo = _run([bin_dir / "clover", "serve", "--demo", "--max-tokens", str(NEW_TOKENS)], env, user)
    assert "2 prompts through Triton" in demo.stdout and "same text: yes" in demo.stdout


def test_the_wheel_answers_an_openai_request(installed, engine):
    _skip_without_triton()
    from clover.serving.server import free_port

    bin_dir, env, user, purelib = installed
    ports = [str(free_port()) for _ in range(4)]
    proc = subprocess.Popen([bin_dir / "clover", "serve", "--demo", "--openai-port", ports[3], "--http-port", ports[0],
                             "--grpc-port", ports[1], "--metrics-port", ports[2], "--log-file", "-"],
                            env=env, cwd=user, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True).start()
    try:
        url = _openai_url(proc, lines)
        request = urllib.request.Request(f"{url}/chat/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "clover", "max_tokens": NEW_TOKENS, "messages": [
                                             {"role": "user", "content": "Name three fruits."}]}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] <= NEW_TOKENS
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(120)
    assert code == 0, "".join(lines)


def _openai_url(proc, lines: list[str], timeout_s: float = 300.0) -> str:
    """The OpenAI endpoint's base URL, once clover serve says it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"OpenAI-compatible endpoint ready \(pid \d+\): (\S+/v1)", "".join(lines))
        if found:
            return found.group(1)
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.25)
    raise AssertionError("the OpenAI endpoint was not ready:\n" + "".join(lines))


def _skip_without_triton() -> None:
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install -e '.[serve]'")
    pytest.importorskip("fastapi", reason="fastapi is not installed: pip install -e '.[serve]'")
    from clover.serving.server import ServerError, find_tritonserver

    try:
        find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")
