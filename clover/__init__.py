"""Clover: regressive speculative decoding that never changes what the model outputs."""

from clover.config import DrafterConfig, SamplingConfig, TargetConfig, TreeConfig
from clover.decode import GenerationRequest, SequenceResult, SpeculativeDecoder

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
