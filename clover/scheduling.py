"""Which waiting requests the next decode step prefills (docs/serving.md#first-tokens-under-a-burst).

A step that prefills a whole burst before any of it decodes makes every request of the burst wait for the last
one's prompt: 32 streams through the OpenAI endpoint all got their first token at about the same time, 7.3 s
after they arrived (issue 62). With a cap on the tokens of one step (vLLM's ``max_num_batched_tokens``), the
burst is prefilled a chunk of prompts per step, in arrival order; each chunk's first tokens go out as soon as
its pass ends, and the requests already running decode between the chunks.

The cap counts the prompt tokens the step prefills plus one token per sequence already decoding. A prompt is
never split across steps (each prompt pass starts from an empty cache row), so the oldest waiting prompt goes
in whenever the batch has room, even alone over the cap: a long prompt is prefilled alone in its step and is
never overtaken by shorter ones behind it.
"""

from __future__ import annotations

from typing import Sequence


def prompts_to_admit(waiting_lengths: Sequence[int], room: int, decoding_rows: int,
                     max_step_tokens: int | None) -> int:
    """How many of the waiting prompts (their lengths in tokens, oldest first) the next step prefills.

    At most ``room`` (free batch rows); with ``max_step_tokens`` (None: no cap), only while the admitted
    prompts' tokens plus ``decoding_rows`` stay within it, the oldest excepted (see the module's docstring).
    Always the oldest ones: a later prompt that would fit never goes in before an earlier one that does not.
    """
    count = min(room, len(waiting_lengths))
    if max_step_tokens is None or count == 0:
        return count
    taken, tokens = 1, decoding_rows + waiting_lengths[0]
    while taken < count and tokens + waiting_lengths[taken] <= max_step_tokens:
        tokens += waiting_lengths[taken]
        taken += 1
    return taken
