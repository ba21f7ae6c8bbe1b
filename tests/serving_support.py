"""Shared by the serving tests: a tiny ONNX Runtime engine and solo greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest

from clover.prompts import encode_prompt
from clover.decode import GenerationRequest, SequenceResult, SpeculativeDecoder
from tests.conftest import write_tiny_checkpoint
from tests.helpers import hf_greedy

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
    """What every served answer must equal: transformers greedy decoding of the engine's checkpoint
    (tests/helpers.py::hf_greedy, independent of clover's decode loop), up to EOS.

    Returns the solo (batch 1) vanilla :class:`SequenceResult` of the same engine (for its text and finish
    reason) after checking that its tokens are exactly the independent reference's.
    """

    def __init__(self, engine_dir: Path, checkpoint: Path | None = None) -> None:
        from clover.backends.onnxruntime import OnnxRuntimeEngine
        from clover.target import load_tokenizer

        self.engine = OnnxRuntimeEngine(engine_dir, threads=1)
        self.tokenizer = load_tokenizer(engine_dir)
        self.checkpoint = checkpoint or Path(engine_dir).parent / "checkpoint"  # as build_tiny_engine lays it out
        self._cache: dict = {}

    def prompt_ids(self, prompt: str, chat: bool = True) -> list[int]:
        """The prompt's ids straight from the tokenizer (its chat template), checked against clover's encoding."""
        if chat:
            ids = list(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True, return_dict=False))
        else:
            ids = self.tokenizer.encode(prompt)
        assert encode_prompt(self.tokenizer, prompt, chat) == ids
        return ids

    def __call__(self, prompt: str, max_tokens: int, chat: bool = True) -> SequenceResult:
        key = (prompt, max_tokens, chat)
        if key not in self._cache:
            ids = self.prompt_ids(prompt, chat)
            expected = hf_greedy(self.checkpoint, [ids], max_tokens, stop_token_ids=(self.tokenizer.eos_token_id,))[0]
            decoder = SpeculativeDecoder(self.engine, "vanilla", tokenizer=self.tokenizer)
            result = decoder.generate([GenerationRequest(ids, max_new_tokens=max_tokens)])[0]
            assert result.token_ids == expected, f"clover's vanilla decoding of {prompt!r} is not greedy"
            self._cache[key] = result
        return self._cache[key]

    def unused_token(self, prompt: str, max_tokens: int) -> int:
        """A token id that greedy decoding of ``prompt`` does not produce within ``max_tokens`` (an ``end_id``
        that never ends the answer, for tests that need a long one)."""
        produced = set(hf_greedy(self.checkpoint, [self.prompt_ids(prompt)], max_tokens)[0])
        return min(t for t in range(self.engine.spec.vocab_size) if t not in produced)


def long_answer_prompt(reference: Reference, max_tokens: int, at_least: int | None = None) -> str:
    """The first of PROMPTS whose greedy answer on the tiny random target runs ``at_least`` tokens (default: all
    ``max_tokens``, no EOS before): a streamed answer needs several steps, and which prompts give one depends
    on the random weights."""
    at_least = max_tokens if at_least is None else at_least
    return next(p for p in PROMPTS if len(reference(p, max_tokens).token_ids) >= at_least)


@pytest.fixture(scope="session")
def reference(tiny_engine_dir) -> Reference:
    return Reference(tiny_engine_dir)
