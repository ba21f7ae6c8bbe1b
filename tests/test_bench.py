"""`python -m clover.bench --quick` on tiny engines: JSON, Markdown and PNGs with every method,
and the Triton sweep through the real server."""

from __future__ import annotations

import json

import pytest

from clover.bench import main as bench_main
from clover.bench import parse_args
from clover.drafters import save_drafter
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import hf_greedy

quiet = dict(progress=lambda message: None)
METHODS = ["vanilla", "medusa", "clover", "adaptive-clover", "default-clover"]


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
    assert {a["aim"].split(",")[0] for a in report["aims"]} >= {"default clover / vanilla tokens/s",
                                                               "adaptive clover / vanilla tokens/s"}
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
    assert set(methods) == set(METHODS)
    for entry in methods.values():
        assert entry["x"] == [1, 2]
        for key in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"):
            assert all(s is not None and s["median"] > 0 for s in entry[key]), key
    samples = [s for s in report["samples"] if s["sweep"] == "triton"]
    assert len(samples) == 2 * 2 * len(METHODS)  # 2 repeats x 2 concurrencies x methods, interleaved
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
    assert len({model for model, *_ in served}) == len(METHODS)
    assert "## triton: inter-token latency p50 (ms)" in (out / "bench.md").read_text()
    assert (out / "triton.png").stat().st_size > 5000
