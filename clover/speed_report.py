"""What ``clover generate`` and ``clover serve --demo`` say about speed: one measurement, one explanation.

Both decode each prompt twice on the same engine, with the speculative method and with vanilla decoding
(one target pass per token), and report per prompt the tokens per target pass ("tokens/step") and the
speed-up against vanilla; where speculation did not pay, one line says why (docs/results/cpu-speed.md#reading-the-numbers).
Single runs on a busy machine vary by more than the speed-ups at stake, so every report ends with the command
that measures real numbers: ``python -m clover.bench`` (medians over interleaved repeats).
"""

from __future__ import annotations

import dataclasses

BENCH_POINTER = ("one run per prompt, so expect noise: for real numbers run python -m clover.bench "
                 "(medians of repeats; README.md#speed)")
# below this many tokens per target pass the drafts were rarely right: the text was new to them
FEW_ACCEPTED_TOKENS_PER_STEP = 1.5
# a speed-up smaller than this (either way) is within a single run's noise
NOISE = 0.05


@dataclasses.dataclass(frozen=True)
class PromptSpeed:
    """One prompt decoded with the speculative method and with vanilla decoding."""

    new_tokens: int
    seconds: float
    tokens_per_step: float
    acceptance_rate: float
    vanilla_new_tokens: int
    vanilla_seconds: float
    same_text: bool | None = None  # None: sampled, so the texts may differ

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def vanilla_tokens_per_second(self) -> float:
        return self.vanilla_new_tokens / self.vanilla_seconds if self.vanilla_seconds > 0 else 0.0

    @property
    def speedup(self) -> float:
        """Tokens/s against vanilla's on the same prompt and engine."""
        vanilla = self.vanilla_tokens_per_second
        return self.tokens_per_second / vanilla if vanilla > 0 else 0.0


def combined(rows: list[PromptSpeed]) -> PromptSpeed:
    """All prompts as one: tokens and seconds summed, tokens/step and acceptance weighted by tokens."""
    tokens = sum(r.new_tokens for r in rows)

    def weighted(field: str) -> float:
        return sum(getattr(r, field) * r.new_tokens for r in rows) / tokens if tokens else 0.0

    same = [r.same_text for r in rows]
    return PromptSpeed(tokens, sum(r.seconds for r in rows), weighted("tokens_per_step"),
                       weighted("acceptance_rate"), sum(r.vanilla_new_tokens for r in rows),
                       sum(r.vanilla_seconds for r in rows), None if None in same else all(same))


def reason(speed: PromptSpeed) -> str | None:
    """One line on why speculation did not pay, or could not, for this answer; None where it paid."""
    if speed.tokens_per_step < FEW_ACCEPTED_TOKENS_PER_STEP:  # whatever one run's timing says
        return (f"this answer is new text: the drafts were rarely right ({speed.tokens_per_step:.2f} tokens/step), "
                "so speculation had little to gain and any difference from vanilla is noise; answers that repeat "
                "their prompt or themselves gain most")
    if speed.speedup >= 1.0 + NOISE:
        return None
    if speed.speedup >= 1.0 - NOISE:
        return (f"the drafts were often right ({speed.tokens_per_step:.2f} tokens/step), but on this CPU a pass over "
                "a tree costs nearly as much as the passes it saves (docs/results/cpu-speed.md#why-a-cpu-gains-little)")
    return (f"the drafts were often right ({speed.tokens_per_step:.2f} tokens/step), yet this run was slower: "
            "other work on the machine slows single runs by more than that")


def prompt_line(speed: PromptSpeed, method: str = "clover") -> str:
    """``clover 41.0 tok/s, 2.31 tokens/step, acceptance rate 0.41 | vanilla 35.2 tok/s | x1.16 | same text: yes``
    (no brackets: clover generate prints it after its ``[clover]`` prefix, which a bracket would double)"""
    same = "" if speed.same_text is None else f" | same text: {'yes' if speed.same_text else 'NO'}"
    return (f"{method} {speed.tokens_per_second:.1f} tok/s, {speed.tokens_per_step:.2f} tokens/step, acceptance "
            f"rate {speed.acceptance_rate:.2f} | vanilla {speed.vanilla_tokens_per_second:.1f} tok/s | "
            f"x{speed.speedup:.2f}{same}")


def report_lines(rows: list[PromptSpeed], method: str = "clover") -> list[str]:
    """Per prompt: the measurement and, where speculation did not pay, why; then all prompts together (when
    several) and the pointer to the benchmark."""
    lines = []
    for number, speed in enumerate(rows, 1):
        label = f"prompt {number}: " if len(rows) > 1 else ""
        lines.append(f"{label}{prompt_line(speed, method)}")
        why = reason(speed)
        if why:
            lines.append(f"  why: {why}")
    if len(rows) > 1:
        lines.append(f"all {len(rows)} prompts: {prompt_line(combined(rows), method)}")
    lines.append(BENCH_POINTER)
    return lines


def engine_note(meta) -> str | None:
    """Why an engine cannot gain whatever the text (``meta``: its :class:`~clover.engine_dir.EngineMeta`):
    untrained heads, or no cost model to fall back to vanilla steps where drafting does not pay."""
    if meta.drafter_config is not None and meta.source.get("drafter") is None:
        return ("this engine's draft heads are untrained (initialised from the target): speculative steps cost "
                "more than they save; trained heads (clover build --drafter) give the speed-up")
    if meta.cost_model is None:
        return ("this engine has no cost model, so every step drafts a full tree; rebuild it with calibration "
                "(the default) or run clover build --output DIR --recalibrate, and decoding falls back to vanilla "
                "steps where drafting does not pay")
    return None
