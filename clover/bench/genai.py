"""onnxruntime-genai on the demo target: ONNX Runtime's own LLM runtime, the peer that runs on Clover's runtime.

Its model builder (``python -m onnxruntime_genai.models.builder -p int4 -e cpu``) writes the graph Clover's lean
engine follows (docs/results/lean-graph): one GroupQueryAttention per layer, fused norms, MatMulNBits for every
linear. ``clover.bench --sweeps peers`` decodes with it greedily on the same prompt token ids and threads as
Clover, and times its graph's single pass beside Clover's. An optional extra (``bench``): nothing else in Clover
needs it, and where it is missing the sweep is skipped with this module's install hint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from clover.config import ConfigError

INSTALL_HINT = "pip install onnxruntime-genai onnx_ir (or: pip install -e .[bench])"
PRECISION = "int4"  # the builder's CPU recipe: 4-bit blocks of 32, int8 compute (accuracy level 4)


def require_genai():
    """The ``onnxruntime_genai`` module, or ConfigError saying how to install it."""
    try:
        import onnxruntime_genai
    except ImportError:
        raise ConfigError(f"onnxruntime-genai is not installed; install it with: {INSTALL_HINT}") from None
    return onnxruntime_genai


def build_genai_model(checkpoint: str | Path, output: str | Path) -> Path:
    """The builder's CPU int4 model of the Hugging Face ``checkpoint`` in ``output``, built once (kept where its
    ``genai_config.json`` exists: a half-written directory has none and is rebuilt)."""
    require_genai()
    output = Path(output)
    if (output / "genai_config.json").exists():
        return output
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(output),
               "-p", PRECISION, "-e", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (output / "genai_config.json").exists():
        raise ConfigError(f"onnxruntime-genai's model builder failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
    return output


def load_genai(model_dir: str | Path, threads: int):
    """An ``onnxruntime_genai.Model`` with ``threads`` intra-op threads and no spin-waiting, as Clover's sessions
    (clover/backends/onnxruntime.py)."""
    og = require_genai()
    config = og.Config(str(model_dir))
    options = {"intra_op_num_threads": threads, "session.intra_op.allow_spinning": "0"}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def genai_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Exactly ``max_new`` greedy tokens after ``prompt`` (no stop token: ``min_length`` = ``max_length``)."""
    og = require_genai()
    params = og.GeneratorParams(model)
    total = len(prompt) + max_new
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt):]]


def run_genai(model, prompt: list[int], max_new: int) -> dict:
    """One timed greedy decode (prompt pass included), as :func:`clover.bench.llamacpp.run_llamacpp`."""
    start = time.perf_counter()
    tokens = genai_greedy(model, prompt, max_new)
    seconds = time.perf_counter() - start
    return {"tokens": len(tokens), "seconds": seconds, "tokens_per_s": len(tokens) / seconds, "tokens_per_step": None}


class BuilderGraphPass:
    """One forward pass of the builder's graph (``model.onnx``) in a plain onnxruntime session: ``tokens`` new
    tokens after ``past`` cached ones at batch 1, the cache shared between past and present as onnxruntime-genai
    runs it (``past_present_share_buffer``), for the pass-time table beside Clover's target pass."""

    def __init__(self, model_dir: str | Path, threads: int, max_seq: int = 2048) -> None:
        import numpy as np
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        decoder = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["decoder"]
        shape = (1, decoder["num_key_value_heads"], max_seq, decoder["head_size"])
        self.layers, self.vocab = decoder["num_hidden_layers"], json.loads(
            (Path(model_dir) / "genai_config.json").read_text())["model"]["vocab_size"]
        self.cache = [np.zeros(shape, np.float32) for _ in range(2 * self.layers)]
        self.empty = np.zeros((1, shape[1], 0, shape[3]), np.float32)

    def logits(self, ids: list[int]):
        """float32 ``[len(ids), V]``: one causal pass over ``ids`` from an empty cache (agreement checks:
        benchmarks/target_agreement.py --genai)."""
        import numpy as np

        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
        for layer in range(self.layers):
            for kind in ("key", "value"):
                feeds[f"past_key_values.{layer}.{kind}"] = self.empty
        return self.session.run(["logits"], feeds)[0][0]

    def __call__(self, tokens: int, past: int) -> None:
        import numpy as np

        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.random.randint(0, self.vocab, (1, tokens)).astype(np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, past + tokens), np.int64))
        for layer in range(self.layers):
            for i, kind in enumerate(("key", "value")):
                cache = self.cache[2 * layer + i]
                for bind, name in ((binding.bind_input, f"past_key_values.{layer}.{kind}"),
                                   (binding.bind_output, f"present.{layer}.{kind}")):
                    bind(name, "cpu", 0, np.float32, list(cache.shape), cache.ctypes.data)
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
