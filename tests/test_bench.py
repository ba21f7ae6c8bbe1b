"""`python -m clover.bench --quick` on tiny engines: JSON, Markdown and PNGs with every method,
and the Triton sweep through the real server."""

from __future__ import annotations

import json
import sys

import pytest

from clover.bench import main as bench_main
from clover.bench import parse_args
from clover.drafters import save_drafter
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import hf_greedy

quiet = dict(progress=lambda message: None)
METHODS = ["vanilla", "medusa", "clover", "clover+suffix", "suffix", "adaptive-clover", "default-clover", "default-heads",
           "default-suffix"]
# the Triton sweep serves one model per line of the figure a user compares: the heads alone, and the defaults
TRITON_METHODS = ["vanilla", "medusa", "clover", "adaptive-clover", "default-clover"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    checkpoint = write_tiny_checkpoint(root / "ckpt")
    clover = build_engine(root / "clover", str(checkpoint), None, max_seq=128, num_heads=3, **quiet)  # no cost model
    heads = root / "medusa-heads"
    save_drafter(make_drafter(load_target(checkpoint), method="medusa", num_heads=3), heads)
    medusa = build_engine(root / "medusa", str(checkpoint), str(heads), max_seq=128, **quiet)
    return clover, medusa


def test_quick_bench_writes_every_method(engines, tmp_path):
    clover, medusa = engines
    out = tmp_path / "report"
    assert bench_main(["--engine", str(clover), "--medusa-engine", str(medusa), "--output", str(out), "--quick", "--prompts", "builtin",
                       "--sweeps", "batch,budget,heads,hf", "--extra-engine", f"medusa-again={medusa}",
                       "--silent", "--max-new-tokens", "8", "--threads", "1"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["sweeps"]) == {"batch", "budget", "heads", "hf"}
    batch = report["sweeps"]["batch"]["methods"]
    assert set(batch) == set(METHODS) | {"medusa-again"}
    # the same engine under two labels decodes the same tokens: equal tokens/step in every repeat
    assert batch["medusa-again"]["tokens_per_step"] == batch["medusa"]["tokens_per_step"]
    for name in METHODS:
        assert batch[name]["x"] == [1, 2, 4]
        assert all(s["n"] == 2 and s["min"] <= s["median"] <= s["max"] and s["median"] > 0
                   for s in batch[name]["tokens_per_s"])
    for sample in (s for s in report["samples"] if s["sweep"] == "batch"):  # where each decode's time went
        assert sample["target_ms"] > 0 and sample["host_ms"] >= 0 and sample["draft_ms"] >= 0
        if sample["method"] == "vanilla":
            assert sample["draft_ms"] == 0
        elif sample["method"] in ("clover", "medusa"):  # fixed budgets draft every step; adaptive ones may not
            assert sample["draft_ms"] > 0
        elif sample["method"] in ("suffix", "default-suffix"):  # the proposer alone never calls the heads
            assert sample["draft_ms"] == 0 and sample["proposer_ms"] >= 0
        if sample["method"] in ("clover+suffix", "suffix", "default-clover"):  # each source's counts
            assert set(sample["source_counts"]) == {"heads", "suffix"}
    assert report["sweeps"]["budget"]["methods"]["clover"]["x"] == [1, 4, 8]
    heads = report["sweeps"]["heads"]["methods"]["clover"]
    assert heads["x"] == [1, 2, 3]
    assert all(1 <= s["median"] <= k for k, s in zip(heads["x"], heads["tree_depth"]))  # depth limit respected
    assert set(report["sweeps"]["hf"]["methods"]) == {"vanilla", "clover", "hf-greedy", "hf-prompt-lookup"}
    assert report["cost_model"]["target"]  # calibrated in the run: the engine had none
    costs = report["step_costs"]
    assert [c["batch"] for c in costs] == [1, 2, 4]
    for c in costs:  # a tree pass never costs less than a vanilla pass (the model is monotone)
        assert c["verify_ms"] >= c["vanilla_ms"] > 0 and c["draft_ms"] > 0
        assert c["draft_prefill_ms"] == 0  # Clover's engine has no draft_prefill (contract v1)
        assert c["break_even_tokens_per_step"] == pytest.approx((c["verify_ms"] + c["draft_ms"]) / c["vanilla_ms"])
    # every comparison is interleaved: each repeat of a sweep measures all of its configurations
    for sweep in ("batch", "hf"):
        per_repeat = {}
        for s in report["samples"]:
            if s["sweep"] == sweep:
                per_repeat.setdefault(s["repeat"], set()).add((s["x"], s["method"]))
        assert len(per_repeat) == 2 and len({frozenset(v) for v in per_repeat.values()}) == 1
    assert any("budgets" in s for s in report["samples"] if s["method"] == "adaptive-clover")
    # each adaptive line's choices on rows of their own (the default line is adaptive only with a stored model)
    md_rows = (out / "bench.md").read_text().splitlines()
    assert any(row.startswith("| adaptive-clover | 1 | ") for row in md_rows)
    assert {a["aim"].split(",")[0] for a in report["aims"]} >= {"default clover / vanilla tokens/s",
                                                               "adaptive clover / vanilla tokens/s",
                                                               "default suffix / vanilla tokens/s"}
    md = (out / "bench.md").read_text()
    for name in METHODS + ["hf-greedy", "hf-prompt-lookup"]:
        assert f"| {name}" in md or f" {name} |" in md
    assert "## Aims" in md and report["command"] in md and "break-even tokens/step" in md
    for sweep in ("batch", "budget", "heads", "hf"):
        png = out / f"{sweep}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_bench_arguments():
    args = parse_args(["--engine", "e", "--quick"])
    assert args.batch_sizes == [1, 2, 4] and args.repeats == 2 and args.fixed_budgets == []
    full = parse_args(["--engine", "e", "--sweeps", "batch,budget"])
    assert full.batch_sizes == [1, 2, 4, 8, 16, 32] and full.sweeps == ["batch", "budget"] and full.repeats == 5
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e", "--sweeps", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e", "--budgets", "a,b"])
    with pytest.raises(SystemExit):
        parse_args(["--engine", "e", "--extra-engine", "no-label"])
    assert parse_args(["--engine", "e", "--extra-engine", "q8=engines/x"]).extra_engine == [("q8", "engines/x")]


def test_triton_sweep_through_the_real_server(engines, tmp_path, monkeypatch):
    from clover import client as client_module
    from clover.serving.server import ServerError, find_tritonserver

    try:
        find_tritonserver()
    except ServerError as exc:
        pytest.skip(f"no Triton server here: {exc}")
    served = []  # (model, prompt, max_tokens, token_ids) of every request the sweep sends

    class RecordingClient(client_module.GrpcClient):
        def stream(self, prompt, max_tokens=128, stream=True, **options):
            ids = []
            for chunk in super().stream(prompt, max_tokens, stream, **options):
                ids.extend(chunk.token_ids)
                yield chunk
            served.append((self.model, prompt, max_tokens, ids))

    monkeypatch.setattr(client_module, "GrpcClient", RecordingClient)  # run_triton imports it at call time
    clover, medusa = engines
    calibrated = build_engine(tmp_path / "calibrated", str(clover.parent / "ckpt"), None, max_seq=128, num_heads=3,
                              calibrate=True, calibrate_max_tokens=16, **quiet)
    out = tmp_path / "report"
    assert bench_main(["--engine", str(calibrated), "--medusa-engine", str(medusa), "--output", str(out), "--quick", "--prompts", "builtin",
                       "--sweeps", "triton", "--silent", "--max-new-tokens", "6", "--threads", "1"]) == 0
    report = json.loads((out / "bench.json").read_text())
    methods = report["sweeps"]["triton"]["methods"]
    assert set(methods) == set(TRITON_METHODS)
    for entry in methods.values():
        assert entry["x"] == [1, 2]
        for key in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"):
            assert all(s is not None and s["median"] > 0 for s in entry[key]), key
    samples = [s for s in report["samples"] if s["sweep"] == "triton"]
    assert len(samples) == 2 * 2 * len(TRITON_METHODS)  # 2 repeats x 2 concurrencies x methods, interleaved
    # greedy through the server is lossless: every method returns, token for token, transformers' greedy
    # continuation of the chat-templated prompt up to EOS (the server's defaults)
    import transformers

    checkpoint = clover.parent / "ckpt"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert len(served) >= sum(s["x"] * 2 for s in samples)  # the measured requests (and any warm-up)
    for model, prompt, max_tokens, ids in served:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_dict=False)
        expected = hf_greedy(checkpoint, [prompt_ids], max_tokens, stop_token_ids=(tokenizer.eos_token_id,))[0]
        assert ids == expected, (model, prompt)
    assert len({model for model, *_ in served}) == len(TRITON_METHODS)
    assert "## triton: inter-token latency p50 (ms)" in (out / "bench.md").read_text()
    assert (out / "triton.png").stat().st_size > 5000


# -- a killed run resumes -------------------------------------------------------------

from clover.bench import sweeps as bench_module  # noqa: E402
from clover.bench.samples import run_key  # noqa: E402

REAL_RUN_DECODE = bench_module.run_decode
NEW_TOKENS = 6  # the warm-ups decode min(4, NEW_TOKENS) = 4 tokens: that tells them from the measurements
BATCH_NAMES = ["vanilla", "medusa", "clover", "clover+suffix", "suffix", "adaptive-clover", "default-clover",
               "default-heads", "default-suffix"]
CUT = len(BATCH_NAMES) * 2 * 3 // 2  # the batch sweep's repeat 0 (batch 1 and 2) and half of its repeat 1


class Interrupted(Exception):
    """Stands for the kill of a long run, in place of a measurement."""


class RecordedDecodes:
    """Replaces clover.bench.run_decode and records each call; with ``stop_after`` the measurement after that
    many raises :class:`Interrupted`."""

    def __init__(self, monkeypatch, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.warm_ups = []  # (sweep, name, x)
        self.measured = []  # (sweep, name, x, repeat): the repeat is run_decode's first prompt
        self.cost_models = []  # the cost model of every adaptive measurement
        monkeypatch.setattr(bench_module, "run_decode", self)

    def __call__(self, engine, config, prompts, max_new, cost_model=None, first_prompt=0):
        if max_new < NEW_TOKENS:
            self.warm_ups.append((config.sweep, config.name, config.x))
        elif len(self.measured) == self.stop_after:
            raise Interrupted
        else:
            self.measured.append((config.sweep, config.name, config.x, first_prompt))
            if config.tree is not None and config.tree.adaptive:
                self.cost_models.append(cost_model.to_dict())
        return REAL_RUN_DECODE(engine, config, prompts, max_new, cost_model, first_prompt)


def resumable_run(engines, out, *settings: str) -> list[str]:
    clover, medusa = engines
    return ["--engine", str(clover), "--medusa-engine", str(medusa), "--output", str(out), "--prompts", "builtin",
            "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", *settings]


def report_keys(out) -> list[tuple]:
    samples = json.loads((out / "bench.json").read_text())["samples"]
    return sorted((s["sweep"], s["method"], s["x"], s["repeat"]) for s in samples)


def stored_keys(out) -> list[tuple]:
    lines = (out / "samples.jsonl").read_text().splitlines()
    return [(s["sweep"], s["method"], s["x"], s["repeat"]) for s in map(json.loads, lines)]


def heads_keys(repeats: int) -> list[tuple]:
    return sorted(("heads", "clover", k, r) for k in (1, 2, 3) for r in range(repeats))


def test_a_killed_run_resumes_where_it_stopped(engines, tmp_path, monkeypatch, capsys):
    import clover.adaptive

    out = tmp_path / "report"
    command = resumable_run(engines, out, "--sweeps", "batch,heads", "--batch-sizes", "1,2", "--fixed-budgets", "4",
                            "--adaptive-max-budget", "4", "--repeats", "2")
    expected = sorted([("batch", name, b, r) for name in BATCH_NAMES for b in (1, 2) for r in (0, 1)]
                      + heads_keys(2))
    first = RecordedDecodes(monkeypatch, stop_after=CUT)
    with pytest.raises(Interrupted):
        bench_main(command + ["--silent"])
    assert len(first.measured) == CUT and stored_keys(out) == first.measured  # each kept as it was measured
    assert not (out / "bench.json").exists()

    def no_calibration(*args, **kwargs):
        raise AssertionError("a resumed run calibrated again")

    monkeypatch.setattr(clover.adaptive, "calibrate", no_calibration)
    second = RecordedDecodes(monkeypatch)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal, where the bar is drawn (clover.progress)
    assert bench_main(command) == 0  # not --silent: same run key
    assert len(second.measured) == len(expected) - CUT and not set(first.measured) & set(second.measured)
    assert report_keys(out) == expected  # every sample exactly once, old and new
    # warm-ups: once per configuration measured in this process, none for those the first run finished
    finished = {k[:3] for k in first.measured if first.measured.count(k[:3] + (1 - k[3],))}
    assert finished and sorted(second.warm_ups) == sorted({k[:3] for k in second.measured})
    assert not finished & set(second.warm_ups)
    # adaptive clover kept the cost model calibrated by the first run
    assert first.cost_models and second.cost_models
    assert all(model == first.cost_models[0] for model in first.cost_models + second.cost_models)
    # the interleaving of both runs together: each repeat of a sweep is repeat 0's order rotated by the repeat
    measured = first.measured + second.measured
    for sweep in ("batch", "heads"):
        order = [[k[1:3] for k in measured if k[0] == sweep and k[3] == r] for r in (0, 1)]
        assert order[1] == order[0][1:] + order[0][:1]
    report = json.loads((out / "bench.json").read_text())
    for entry in report["sweeps"]["batch"]["methods"].values():
        assert [s["n"] for s in entry["tokens_per_s"]] == [2, 2]
    err = capsys.readouterr().err
    assert f"resumed {CUT} samples from {out / 'samples.jsonl'}; {len(expected) - CUT} left to measure" in err
    assert "heads clover x=3 repeat 1" in err  # the progress bar names what it measures


def test_other_settings_need_fresh(engines, tmp_path, monkeypatch, capsys):
    out = tmp_path / "report"
    command = resumable_run(engines, out, "--sweeps", "heads", "--silent")
    RecordedDecodes(monkeypatch, stop_after=2)
    with pytest.raises(Interrupted):
        bench_main(command + ["--repeats", "2"])
    kept = (out / "samples.jsonl").read_bytes()
    refused = RecordedDecodes(monkeypatch)
    capsys.readouterr()
    assert bench_main(command + ["--repeats", "3"]) == 2
    err = capsys.readouterr().err
    assert "other settings (different: repeats)" in err and "--fresh" in err and "another --output" in err
    assert not refused.measured and not refused.warm_ups and (out / "samples.jsonl").read_bytes() == kept
    fresh = RecordedDecodes(monkeypatch)
    assert bench_main(command + ["--repeats", "3", "--fresh"]) == 0
    assert len(fresh.measured) == 9 and report_keys(out) == heads_keys(3) and len(stored_keys(out)) == 9
    again = RecordedDecodes(monkeypatch)  # all measured: nothing to measure, nothing to warm up
    assert bench_main(command + ["--repeats", "3"]) == 0
    assert not again.measured and not again.warm_ups and report_keys(out) == heads_keys(3)


def test_a_line_cut_by_the_kill_is_ignored(engines, tmp_path, monkeypatch):
    out = tmp_path / "report"
    command = resumable_run(engines, out, "--sweeps", "heads", "--repeats", "2", "--silent")
    first = RecordedDecodes(monkeypatch, stop_after=3)
    with pytest.raises(Interrupted):
        bench_main(command)
    cut = json.dumps({"sweep": "heads", "x": 1, "method": "clover", "batch": 1, "repeat": 1, "tokens": 6})[:-9]
    with (out / "samples.jsonl").open("a") as f:
        f.write(cut)  # the start of the next sample: the kill came while it was written
    second = RecordedDecodes(monkeypatch)
    assert bench_main(command) == 0
    assert ("heads", "clover", 1, 1) in second.measured and len(second.measured) == 6 - 3
    assert sorted(first.measured + second.measured) == report_keys(out) == heads_keys(2)
    assert sorted(stored_keys(out)) == heads_keys(2)  # every line of the file whole again


def test_lines_measure_only_the_named_lines_and_refuse_unknown_ones(engines, tmp_path, monkeypatch, capsys):
    out = tmp_path / "report"
    command = resumable_run(engines, out, "--sweeps", "batch", "--batch-sizes", "1", "--repeats", "1",
                            "--silent")
    recorded = RecordedDecodes(monkeypatch)
    assert bench_main(command + ["--lines", "vanilla,default-suffix"]) == 0
    assert sorted(recorded.measured) == [("batch", "default-suffix", 1, 0), ("batch", "vanilla", 1, 0)]
    assert set(json.loads((out / "bench.json").read_text())["sweeps"]["batch"]["methods"]) == {"vanilla",
                                                                                             "default-suffix"}
    capsys.readouterr()
    assert bench_main(command + ["--lines", "vanilla,defualt-suffix", "--fresh"]) == 2
    err = capsys.readouterr().err
    assert "--lines defualt-suffix: no such line" in err and "default-suffix" in err


def test_run_key_holds_what_changes_the_measurements(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = run_key(parse_args(["--engine", "e", "--quick"]))
    same = ["--engine", str(tmp_path / "e"), "--quick", "--output", "elsewhere", "--silent", "--fresh"]
    assert run_key(parse_args(same)) == base
    for change in (["--threads", "2"], ["--repeats", "3"], ["--max-new-tokens", "5"], ["--prompts", "builtin"],
                   ["--sweeps", "batch"], ["--num-prompts", "3"], ["--medusa-engine", "m"], ["--budget", "2"],
                   ["--extra-engine", "q8=x"], ["--batch-sizes", "1,2"]):
        assert run_key(parse_args(["--engine", "e", "--quick", *change])) != base, change


def test_aims_pair_each_repeat_with_its_own_vanilla_run():
    from clover.bench import aims, paired_ratio

    def sample(method, repeat, rate, x=1):
        return {"sweep": "batch", "x": x, "method": method, "repeat": repeat, "tokens_per_s": rate}

    # the machine drifts between repeats (vanilla 10, 30, 20 tokens/s); each repeat's own ratio is what counts
    samples = [sample("vanilla", 0, 10.0), sample("default-clover", 0, 15.0), sample("vanilla", 1, 30.0),
               sample("default-clover", 1, 30.0), sample("vanilla", 2, 20.0), sample("default-clover", 2, 24.0),
               sample("default-clover", 3, 99.0)]  # no vanilla run in repeat 3: no pair
    stat = paired_ratio(samples, "batch", "default-clover", "vanilla", 1)
    assert stat == pytest.approx({"median": 1.2, "min": 1.0, "max": 1.5, "n": 3})
    row = next(a for a in aims(samples) if a["aim"] == "default clover / vanilla tokens/s, batch 1" and a["goal"] == 0.95)
    assert row["ratio"] == pytest.approx(1.2) and row["min"] == pytest.approx(1.0) and row["met"] is True
    assert paired_ratio(samples, "batch", "default-clover", "vanilla", 8) is None


def test_peers_and_passes_sweeps_measure_what_runs_here_and_say_what_was_left_out(engines, tmp_path, monkeypatch):
    """The peer runtimes are optional: a missing one is left out with its install hint, and the lines that run
    here (Clover's decoding and target passes) are measured and paired as the aims say."""
    import clover.bench.genai
    import clover.bench.llamacpp
    from clover.config import ConfigError

    def missing(*args, **kwargs):
        raise ConfigError("not installed here (test)")

    monkeypatch.setattr(clover.bench.genai, "require_genai", missing)
    monkeypatch.setattr(clover.bench.llamacpp, "require_llama_cpp", missing)
    clover_engine, medusa = engines
    out = tmp_path / "report"
    assert bench_main(["--engine", str(clover_engine), "--vanilla-engine", f"other={medusa}", "--output", str(out),
                       "--quick", "--prompts", "builtin", "--sweeps", "peers,passes", "--silent",
                       "--max-new-tokens", "8", "--threads", "1", "--pass-past", "64"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert set(report["sweeps"]["peers"]["methods"]) == {"vanilla", "default-clover", "vanilla-other"}
    passes = report["sweeps"]["passes"]["methods"]
    assert set(passes) == {"clover", "vanilla-other"} and passes["clover"]["x"] == [1, 2, 4, 8, 16, 32]
    assert all(s["median"] > 0 for s in passes["clover"]["target_ms"])
    notes = " ".join(report["notes"])
    assert "onnxruntime-genai left out" in notes and "llama.cpp sweep skipped" in notes
    aims = {a["aim"]: a for a in report["aims"]}
    assert aims["vanilla / onnxruntime-genai greedy, batch 1"]["ratio"] is None  # nothing to pair with
    assert "## passes: target pass (ms per step)" in (out / "bench.md").read_text()
