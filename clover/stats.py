"""Speculative-decoding statistics shared by the decoder, the server, the clients and the benchmarks.

Pure Python with no imports from the rest of Clover, so even the stand-alone client can use it.
"""

from __future__ import annotations


def tokens_per_step(new_tokens: int, decode_steps: int, sequences: int = 1) -> float:
    """New tokens per decode step (target pass after the prompt), over ``sequences`` sequences; 0.0 without steps.

    Each sequence's first token comes from its prompt pass, not from a decode step, so it is left out
    (docs/trees.md#verification: a step yields the accepted drafts plus one bonus token).
    """
    return (new_tokens - sequences) / decode_steps if decode_steps else 0.0
