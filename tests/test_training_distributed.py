"""Training for real targets (issue 17): torchrun data parallelism, online features, Llama-family checkpoints.

Two tiny gloo processes on CPU stand in for GPUs; the nccl/bf16 path is the same code with another backend
and dtype (docs/status.md says what has run where).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import write_tiny_checkpoint
from tests.helpers import hf_greedy, random_prompts
from training import batches as batches_mod
from training import hidden_cache as cache_mod
from training import train as train_mod
from training.features import online_hidden_states

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 258  # write_tiny_checkpoint's byte-level vocabulary


def conversations(seed: int, count: int = 16) -> list[dict]:
    """Distilled-format records (prompt and response token ids) of random tokens: enough to compare runs."""
    rng = random.Random(seed)
    return [{"id": f"c{i}", "category": "chat", "prompt_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(4, 14))],
             "response_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(8, 30))]} for i in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    ckpt = write_tiny_checkpoint(root / "ckpt")
    records = conversations(0)
    target = load_target(ckpt)
    return {"ckpt": ckpt, "target": target, "records": records, "jsonl": write_jsonl(root / "data.jsonl", records),
            "cache32": cache_mod.build_cache(records, target, root / "cache32", dtype="float32", progress=False),
            "cache16": cache_mod.build_cache(records, target, root / "cache16", dtype="float16", progress=False)}


def config(data, output, **overrides) -> train_mod.TrainConfig:
    base = dict(method="clover", cache=str(data), output=str(output), num_heads=3, decoder_heads=2, batch_tokens=160,
                row_chunk=48, lr=3e-3, epochs=2, save_every=2, log_every=1, progress=False, device="cpu", seed=0)
    base.update(overrides)
    return train_mod.TrainConfig(**base)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / train_mod.STATE_FILE, weights_only=False)["drafter"]


def log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / train_mod.LOG_FILE).read_text().splitlines()]


def assert_same_run(a: Path, b: Path, atol: float = 1e-5) -> None:
    """Same steps, data and loss curve, and the same weights up to float summation order."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=atol, rtol=1e-4, msg=name)
    la, lb = log(a), log(b)
    assert [(r["step"], r["tokens"]) for r in la] == [(r["step"], r["tokens"]) for r in lb]
    np.testing.assert_allclose([r["loss"] for r in lb], [r["loss"] for r in la], rtol=1e-5)


def assert_trained(run: Path, initial: dict[str, torch.Tensor]) -> None:
    """The comparison means something: the weights moved."""
    moved = [n for n, w in weights(run).items() if not torch.allclose(w, initial[n], atol=1e-4)]
    assert "augment.self_attn.q_proj.weight" in moved and "heads.weight" in moved, moved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# data parallelism: the weights do not depend on the number of processes or micro-batches


def test_two_torchrun_processes_equal_one_process_and_grad_accumulation(setup, tmp_path):
    """torchrun --nproc_per_node 2 (gloo, each process half of every batch) == 1 process on whole batches
    == 1 process in 3 micro-batches per step."""
    cache = setup["cache32"]
    plan = batches_mod.make_plan(cache_mod.HiddenCache(cache).conversations, 160, 2, 0)
    sizes = [len(b) for b in plan]  # conversations per step: most split between the processes; in a
    assert sum(n >= 2 for n in sizes) >= 4 and 1 in sizes, sizes  # 1-conversation step, rank 1 only joins the sums
    one = train_mod.train(config(cache, tmp_path / "one"), target=setup["target"])
    train_mod.train(config(cache, tmp_path / "accum", grad_accum=3), target=setup["target"])
    flags = ["--method", "clover", "--cache", str(cache), "--target", str(setup["ckpt"]), "--num-heads", "3",
             "--decoder-heads", "2", "--batch-tokens", "160", "--row-chunk", "48", "--lr", "3e-3", "--epochs", "2",
             "--save-every", "2", "--log-every", "1", "--seed", "0", "--device", "cpu", "--no-progress"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "training.train", *flags, "--output", str(tmp_path / "two")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 1, "one summary line, from rank 0"
    two = json.loads((tmp_path / "two" / train_mod.SUMMARY_FILE).read_text())
    assert two["processes"] == 2 and one["processes"] == 1 and two["steps"] == one["steps"] == len(plan)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    assert_same_run(tmp_path / "one", tmp_path / "accum")
    initial = train_mod.build_drafter(config(cache, tmp_path / "x"), setup["target"]).state_dict()
    assert_trained(tmp_path / "one", initial)
    assert all(r["max_memory_mb"] > 0 for r in log(tmp_path / "two"))


def _rank_main(rank: int, world_size: int, port: int, cfg: dict, ckpt: str, stop_at: int) -> None:
    """One torchrun-like rank (the environment torchrun sets); stops after step ``stop_at`` like a kill."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)

    def stop(step):
        if step == stop_at:
            raise train_mod.Interrupted

    try:
        train_mod.train(train_mod.TrainConfig(**cfg), target=load_target(ckpt), on_step=stop)
    except train_mod.Interrupted:
        pass


def test_resume_with_another_number_of_processes(setup, tmp_path):
    """Online features: 1 process killed after step 3 (checkpoint at 2), 2 processes resume and are killed
    after step 4, 1 process finishes: the weights of an uninterrupted run."""
    target = setup["target"]
    ref = train_mod.train(config(setup["jsonl"], tmp_path / "ref", features="online"), target=target)
    assert ref["steps"] > 5
    cfg = config(setup["jsonl"], tmp_path / "cut", features="online")

    def kill(step):
        if step == 3:
            raise train_mod.Interrupted

    with pytest.raises(train_mod.Interrupted):
        train_mod.train(cfg, target=target, on_step=kill)
    assert torch.load(tmp_path / "cut" / train_mod.STATE_FILE, weights_only=False)["step"] == 2
    torch.multiprocessing.spawn(_rank_main, args=(2, free_port(), vars(cfg), str(setup["ckpt"]), 4), nprocs=2)
    assert torch.load(tmp_path / "cut" / train_mod.STATE_FILE, weights_only=False)["step"] == 4
    assert not (tmp_path / "cut" / train_mod.SUMMARY_FILE).exists()
    resumed = train_mod.train(cfg, target=target)
    assert resumed["steps"] == ref["steps"]
    assert_same_run(tmp_path / "ref", tmp_path / "cut")


# ---------------------------------------------------------------------------
# features on the fly


def test_online_features_equal_the_cache(setup):
    cache = cache_mod.HiddenCache(setup["cache16"])
    indices = list(range(len(cache)))[:6]
    batch = batches_mod.collate(cache, indices, True, True)
    tokens_only = batches_mod.collate(cache, indices, False, False)
    assert tokens_only.x_in is None and tokens_only.x_last is None
    assert torch.equal(tokens_only.tokens, batch.tokens) and torch.equal(tokens_only.assistant, batch.assistant)
    x_in, x_last = online_hidden_states(setup["target"], tokens_only.tokens, True, True)
    inside = (torch.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None])[..., None]  # padding aside
    for online, cached in ((x_in, batch.x_in), (x_last, batch.x_last)):
        assert online.dtype == torch.float32 and not online.is_inference()
        scale = float(cached.abs().max())
        torch.testing.assert_close(online * inside, cached * inside, atol=2e-3 * scale, rtol=1e-3)  # fp16 cache


def test_online_training_equals_cached_training(setup, tmp_path):
    """The same loss curve and weights from the fp32 cache and from the target on the fly; soft labels read
    the last hidden state too. Gradient checkpointing of the Augmenting Block changes nothing."""
    extra = dict(labels="soft", epochs=1)
    train_mod.train(config(setup["cache32"], tmp_path / "cached", **extra), target=setup["target"])
    train_mod.train(config(setup["jsonl"], tmp_path / "online", features="online", **extra), target=setup["target"])
    train_mod.train(config(setup["jsonl"], tmp_path / "ckpt", features="online", grad_checkpoint=True, **extra),
                    target=setup["target"])
    assert_same_run(tmp_path / "cached", tmp_path / "online")
    assert_same_run(tmp_path / "online", tmp_path / "ckpt", atol=1e-6)


# ---------------------------------------------------------------------------
# Llama-family checkpoints: train, export, decode losslessly


@pytest.mark.parametrize("model_type,overrides", [
    ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 64}),  # attention equals full causal attention up to 64 tokens: the cap
])
def test_llama_family_checkpoint_trains_exports_and_decodes_losslessly(tmp_path, model_type, overrides):
    from safetensors.torch import load_file, save_file

    ckpt = write_tiny_checkpoint(tmp_path / model_type, model_type=model_type, seed=2, **overrides)
    weights_file = ckpt / "model.safetensors"  # bf16 weights, as published checkpoints ship them
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights_file).items()}, weights_file,
              metadata={"format": "pt"})
    hf_config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**hf_config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    target = load_target(ckpt)
    assert target.config.architecture == model_type
    if model_type == "mistral":
        assert target.config.max_position_embeddings == 64
    data = write_jsonl(tmp_path / "data.jsonl", conversations(1, count=8))
    assert train_mod.main(["--method", "clover", "--cache", str(data), "--features", "online", "--target", str(ckpt),
                           "--output", str(tmp_path / "heads"), "--num-heads", "3", "--batch-tokens", "160",
                           "--epochs", "2", "--device", "cpu", "--no-progress"]) == 0
    assert json.loads((tmp_path / "heads" / train_mod.SUMMARY_FILE).read_text())["steps"] >= 3
    engine_dir = build_engine(tmp_path / "engine", str(ckpt), str(tmp_path / "heads"), max_seq=256,
                              progress=lambda message: None)
    engine = OnnxRuntimeEngine(engine_dir)
    prompts = random_prompts(4, 3, VOCAB, 2, 20)
    expected = hf_greedy(ckpt, prompts, 24)  # transformers generate() on the checkpoint itself
    results = SpeculativeDecoder(engine, "clover", TreeConfig(budget=6)).generate(
        [GenerationRequest(p, max_new_tokens=24, stop_token_ids=()) for p in prompts])
    assert [r.token_ids for r in results] == expected
    assert sum(sum(r.stats.depth_tried) for r in results) > 0


def test_unsupported_checkpoints_are_clear_errors(tmp_path, capsys):
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB).save_pretrained(tmp_path / "gpt2")
    data = write_jsonl(tmp_path / "data.jsonl", conversations(1, count=2))
    assert train_mod.main(["--method", "clover", "--cache", str(data), "--features", "online", "--target",
                           str(tmp_path / "gpt2"), "--output", str(tmp_path / "run"), "--device", "cpu"]) == 2
    message = capsys.readouterr().err
    assert "model_type='gpt2'" in message and "llama, mistral, qwen2" in message
    quantized = tmp_path / "awq"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4}}))
    with pytest.raises(ConfigError, match="quantized checkpoint .awq.*bf16"):
        load_target(quantized)
    with pytest.raises(ConfigError, match="features 'disk'"):
        train_mod.train(config(data, tmp_path / "bad", features="disk"))


def test_cost_probe_reports_time_memory_and_parameters(setup, monkeypatch, capsys):
    """training/experiments/cost_probe.py (the per-token costs docs/train-your-own.md scales), on a checkpoint and on a
    random-weight target of a named shape (here a tiny one; llama3-8b on a GPU)."""
    from training.experiments import cost_probe

    small = ["--device", "cpu", "--batch-tokens", "128", "--seq-len", "32", "--repeats", "1", "--row-chunk", "16"]
    assert cost_probe.main(["--target", str(setup["ckpt"]), *small]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_per_step"] == 128 and result["roots_per_step"] == 4 * 15  # 16 answer positions, last not
    assert result["params"]["target"] == sum(p.numel() for p in setup["target"].parameters())
    assert result["target_tokens_per_s"] > 0 and result["peak_memory_mb"]["train_step"] > 0
    monkeypatch.setitem(cost_probe.SHAPES, "tiny", dict(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8))
    assert cost_probe.main(["--shape", "tiny", "--grad-checkpoint", *small]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "tiny" and result["params"]["lm_head"] == 97 * 32


def test_throughput_sweep_runs_every_setting_and_records_one_out_of_memory(tmp_path, monkeypatch):
    """training/experiments/throughput_sweep.py's dry run (tiny random target, CPU): one row per setting with answer
    tokens/s half the online rate; a setting that runs out of memory is a row saying so, and the sweep fails only
    when no setting ran."""
    from training.experiments import cost_probe, throughput_sweep

    assert throughput_sweep.main(["--dry-run", "--output", str(tmp_path / "ok")]) == 0
    rows = json.loads((tmp_path / "ok" / "sweep.json").read_text())["rows"]
    assert [r["batch_tokens"] for r in rows] == [256, 512] and [r["tokens_per_step"] for r in rows] == [256, 512]
    assert all(r["answer_tokens_per_s"] == round(r["online_tokens_per_s"] / 2, 1) > 0 for r in rows)
    assert "Fastest: batch tokens" in (tmp_path / "ok" / "sweep.md").read_text()

    real_probe = cost_probe.probe

    def probe(args):
        if args.batch_tokens > 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return real_probe(args)
    monkeypatch.setattr(cost_probe, "probe", probe)
    assert throughput_sweep.main(["--dry-run", "--output", str(tmp_path / "oom")]) == 0
    rows = json.loads((tmp_path / "oom" / "sweep.json").read_text())["rows"]
    assert "error" not in rows[0] and rows[1]["error"].startswith("out of memory")
    monkeypatch.setattr(cost_probe, "probe", lambda args: probe(argparse.Namespace(**{**vars(args),
                                                                                   "batch_tokens": 10**6})))
    assert throughput_sweep.main(["--dry-run", "--output", str(tmp_path / "none")]) == 1
