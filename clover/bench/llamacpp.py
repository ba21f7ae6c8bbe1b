"""llama.cpp on the demo GGUF: the baseline a CPU user would pick (optional extra ``llamacpp``).

llama-cpp-python runs the same ``SmolLM2-135M-Instruct.Q4_1.gguf`` the demo ships, with its own Q4_1 / Q8_0
kernels, and has its own prompt-lookup speculative decoding (``LlamaPromptLookupDecoding``). ``clover.bench``
measures both against Clover (docs/quantized-target.md#against-llamacpp). Nothing else in Clover needs it:
it builds from source (a few minutes on 2 cores), so it is an optional extra, never a test or CI requirement.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from clover.config import ConfigError

LLAMACPP_VERSION = "0.3.36"  # the version measured in docs/results/quantized-target
INSTALL_HINT = (f'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python=={LLAMACPP_VERSION} '
                "(or: pip install -e .[llamacpp]; it builds llama.cpp from source, minutes)")


def require_llama_cpp():
    """The ``llama_cpp`` module, or ConfigError saying how to install it.

    llama.cpp's OpenMP threads spin between ops unless ``OMP_WAIT_POLICY=PASSIVE`` is in the environment when
    the process starts (torch loads the same libgomp first, and it reads the variable then): see
    :func:`wait_policy`.
    """
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"llama-cpp-python is not installed; install it with: {INSTALL_HINT}") from None
    return llama_cpp


def load_llama(gguf: str | Path | None = None, threads: int = 2, logits_all: bool = False,
               prompt_lookup: int | None = None, n_ctx: int = 2048):
    """A ``llama_cpp.Llama`` on ``gguf`` (default: the demo GGUF) with ``threads`` threads for decoding and
    prompts; ``prompt_lookup``: that many draft tokens per step from ``LlamaPromptLookupDecoding``."""
    llama_cpp = require_llama_cpp()
    if gguf is None:
        from clover.demo import find_demo_gguf

        gguf = find_demo_gguf()
    draft = None
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
    return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           logits_all=logits_all or draft is not None, draft_model=draft, verbose=False)


def llama_greedy(llama, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Greedy decoding (``temp=0``: llama.cpp's greedy sampler) of ``prompt`` token ids from an empty cache: at
    most ``max_new`` tokens, stopping after ``eos`` (kept, as Clover's decode loop keeps its stop token)."""
    llama.reset()  # no prompt-cache reuse between calls: every decode pays its prompt pass
    out: list[int] = []
    for token in llama.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) >= max_new or token == eos:
            break
    return out


def run_llamacpp(llama, prompt: list[int], max_new: int) -> dict:
    """One timed greedy decode of exactly ``max_new`` tokens (no stop token), as :func:`clover.bench.sweeps.run_hf`:
    the prompt pass included."""
    start = time.perf_counter()
    tokens = llama_greedy(llama, prompt, max_new)
    seconds = time.perf_counter() - start
    return {"tokens": len(tokens), "seconds": seconds, "tokens_per_s": len(tokens) / seconds,
            "tokens_per_step": None}


def wait_policy() -> str:
    """The OpenMP wait policy llama.cpp runs with. Passive is the fair match for onnxruntime here (its threads do
    not spin: ``allow_spinning`` 0, clover/backends/onnxruntime.py); spinning threads take the cores other work
    needs, and on a loaded 2-core machine llama.cpp ran at 1-4 tokens/s spinning against 22-43 passive
    (docs/quantized-target.md#against-llamacpp)."""
    return os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP's default: threads spin between ops)")


def build_info() -> dict:
    """llama-cpp-python's version and the CPU features its llama.cpp was built with (for reports)."""
    llama_cpp = require_llama_cpp()
    return {"llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
