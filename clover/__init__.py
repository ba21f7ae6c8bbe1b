"""Clover: regressive speculative decoding that never changes what the model outputs."""

from __future__ import annotations

import importlib

from clover.config import DrafterConfig, SamplingConfig, TargetConfig, TreeConfig

# the decoder's names load clover.decode (and torch) when first asked for, not with the package: ``clover --help``
# and the torch-free clients import clover.* without paying for torch (tests/test_cli.py checks)
_DECODE_NAMES = ("GenerationRequest", "SequenceResult", "SpeculativeDecoder")


def __getattr__(name: str):
    if name in _DECODE_NAMES:
        return getattr(importlib.import_module("clover.decode"), name)
    raise AttributeError(f"module 'clover' has no attribute {name!r}")


__all__ = [
    "DrafterConfig",
    "GenerationRequest",
    "SamplingConfig",
    "SequenceResult",
    "SpeculativeDecoder",
    "TargetConfig",
    "TreeConfig",
]
__version__ = "0.1.0"
