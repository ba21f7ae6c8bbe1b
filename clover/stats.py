"""Speculative-decoding statistics shared by the decoder, the server, the clients and the benchmarks.

Pure Python with no imports from the rest of Clover, so even the stand-alone client can use it.
"""

from __future__ import annotations

import dataclasses


def tokens_per_step(new_tokens: int, decode_steps: int, sequences: int = 1) -> float:
    """New tokens per decode step (target pass after the prompt), over ``sequences`` sequences; 0.0 without steps.

    Each sequence's first token comes from its prompt pass, not from a decode step, so it is left out
    (docs/trees.md#verification: a step yields the accepted drafts plus one bonus token).
    """
    return (new_tokens - sequences) / decode_steps if decode_steps else 0.0


@dataclasses.dataclass
class StepOutcome:
    """What one decode step did for its live rows, whichever loop ran it (the host's or the device's): what the
    step's observers learn from, the adaptive budget and each sequence's statistics. The step itself keeps no
    statistics (docs/architecture.md#one-decode-step).

    budget: the heads' budget the step ran; tree_tokens: tokens in flight per row (the pass's width); per row:
    tree_sizes (nodes, root included), depths (the tree's deepest level), tokens (accepted, the bonus token last),
    heads_accepted (accepted draft tokens the heads proposed: what the heads' budget chooser learns).
    """

    budget: int
    tree_tokens: int
    tree_sizes: list[int]
    depths: list[int]
    tokens: list[list[int]]
    heads_accepted: list[int]

    @property
    def mean_tokens(self) -> float:
        """Tokens a row gained, on average (accepted draft tokens + 1)."""
        return sum(len(t) for t in self.tokens) / len(self.tokens)
