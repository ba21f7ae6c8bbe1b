"""Shared by the serving tests: a tiny ONNX Runtime engine and solo greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover.prompts import encode_prompt
from clover.decode import GenerationRequest, SequenceResult, SpeculativeDecoder
from tests.conftest import write_tiny_checkpoint

# different prompts and lengths (the byte-level tokenizer makes one token per byte)
PROMPTS = ["hello there", "a", "write a poem about the sea", "1 2 3 4", "What is 2+2?", "zzz", "The quick brown fox",
           "Q", "tell me a story about a dragon who lived under a bridge", "¿dónde está?", "ok", "x y", "Triton",
           "speculative decoding", "in-flight batching", "?"]


def build_tiny_engine(root: Path, max_seq: int = 256) -> Path:
    """A tiny random Llama + untrained Clover heads, compiled to an ONNX Runtime engine directory."""
    from clover.export.builder import build_engine

    checkpoint = write_tiny_checkpoint(root / "checkpoint")
    return build_engine(root / "engine", str(checkpoint), None, max_seq=max_seq, max_batch=16,
                        progress=lambda message: None)


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("serving"))


class Reference:
    """Solo (batch 1) vanilla greedy decoding on the same engine: what every served answer must equal."""

    def __init__(self, engine_dir: Path) -> None:
        from clover.backends.onnxruntime import OnnxRuntimeEngine
        from clover.target import load_tokenizer

        self.engine = OnnxRuntimeEngine(engine_dir, threads=1)
        self.tokenizer = load_tokenizer(engine_dir)
        self._cache: dict = {}

    def __call__(self, prompt: str, max_tokens: int, chat: bool = True) -> SequenceResult:
        key = (prompt, max_tokens, chat)
        if key not in self._cache:
            decoder = SpeculativeDecoder(self.engine, "vanilla", tokenizer=self.tokenizer)
            request = GenerationRequest(encode_prompt(self.tokenizer, prompt, chat), max_new_tokens=max_tokens)
            self._cache[key] = decoder.generate([request])[0]
        return self._cache[key]


    def unused_token(self, prompt: str, max_tokens: int) -> int:
        """A token id that greedy decoding of ``prompt`` does not produce within ``max_tokens`` (an ``end_id``
        that never ends the answer, for tests that need a long one)."""
        decoder = SpeculativeDecoder(self.engine, "vanilla", tokenizer=self.tokenizer)
        request = GenerationRequest(encode_prompt(self.tokenizer, prompt), max_new_tokens=max_tokens, stop_token_ids=())
        produced = set(decoder.generate([request])[0].token_ids)
        return min(t for t in range(self.engine.spec.vocab_size) if t not in produced)


@pytest.fixture(scope="session")
def reference(tiny_engine_dir) -> Reference:
    return Reference(tiny_engine_dir)
