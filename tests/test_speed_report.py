"""clover.speed_report: the measurement and explanation clover generate and clover serve --demo share."""

from __future__ import annotations

import dataclasses
import types

from clover.speed_report import BENCH_POINTER, PromptSpeed, combined, engine_note, prompt_line, reason, report_lines

# 96 tokens each; the seconds make the speed-ups 1.50x, 0.96x, 1.00x, 0.80x
COPY = PromptSpeed(96, 2.0, 2.9, 0.6, 96, 3.0, True)
PROSE = PromptSpeed(96, 2.5, 1.1, 0.05, 96, 2.4, True)
GOOD_DRAFTS_EXPENSIVE = PromptSpeed(96, 2.0, 2.4, 0.4, 96, 2.0, True)
GOOD_DRAFTS_SLOW_RUN = PromptSpeed(96, 2.5, 2.4, 0.4, 96, 2.0, True)


def test_speedup_is_tokens_per_second_against_vanilla_s():
    assert abs(COPY.speedup - 1.5) < 1e-9 and abs(PROSE.speedup - 0.96) < 1e-9
    assert PromptSpeed(10, 1.0, 1.0, 0.0, 20, 1.0).speedup == 0.5  # vanilla's own token count


def test_a_reason_only_where_speculation_did_not_pay():
    assert reason(COPY) is None
    assert "new text" in reason(PROSE) and "1.10 tokens/step" in reason(PROSE)
    lucky_prose = dataclasses.replace(PROSE, seconds=2.0)  # x1.20 from noise alone: still explained
    assert "new text" in reason(lucky_prose) and "noise" in reason(lucky_prose)
    assert "costs nearly as much" in reason(GOOD_DRAFTS_EXPENSIVE)
    assert "slower" in reason(GOOD_DRAFTS_SLOW_RUN) and "other work" in reason(GOOD_DRAFTS_SLOW_RUN)


def test_report_lines_give_each_prompt_its_line_and_reason_then_the_total_and_the_benchmark():
    lines = report_lines([COPY, PROSE])
    assert lines[0].startswith("prompt 1: clover 48.0 tok/s, 2.90 tokens/step") and lines[0].endswith("x1.50 | same text: yes")
    assert lines[1].startswith("prompt 2: ") and lines[2].startswith("  why: this answer is new text")
    total = combined([COPY, PROSE])
    assert (total.new_tokens, total.seconds, total.vanilla_seconds) == (192, 4.5, 5.4)
    assert abs(total.tokens_per_step - 2.0) < 1e-9 and total.same_text is True
    assert lines[3] == f"all 2 prompts: {prompt_line(total)}" and lines[-1] == BENCH_POINTER
    single = report_lines([COPY])
    assert single == [prompt_line(COPY), BENCH_POINTER]  # one prompt: no label, no total


def test_a_sampled_answer_is_not_compared_by_text():
    sampled = PromptSpeed(96, 2.0, 2.0, 0.3, 90, 2.0, None)
    assert "same text" not in prompt_line(sampled) and combined([COPY, sampled]).same_text is None


def test_engine_notes_name_untrained_heads_and_a_missing_cost_model():
    def meta(drafter, cost_model):
        return types.SimpleNamespace(drafter_config=object(), source={"drafter": drafter}, cost_model=cost_model)

    assert "untrained" in engine_note(meta(None, object()))
    assert "no cost model" in engine_note(meta("heads", None))
    assert engine_note(meta("heads", object())) is None
