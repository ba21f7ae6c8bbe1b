"""Train Clover / Medusa / ablation heads on a hidden-state cache (docs/drafter.md#training).

    python -m training.train --method clover --cache data/cache/train --output runs/clover \\
        --max-tokens 600000

The target is frozen; only the drafter learns. What one step computes, for each
conversation in the batch (shapes: B conversations padded to T tokens):

* ``h0 [B, T, H]``: the Augmenting Block run causally over the cached input of
  the target's last layer (a fork beside it), or the cached last hidden state
  when the method has no Augmenting Block (Medusa, ``clover-no-augment``).
* Roots: every position t whose next token t+1 is an assistant token. At
  inference t is the last accepted position, ``h0[t]`` the root hidden state and
  token t+1 the target's own next token ``tok0``.
* Head i (0-based) at root t predicts token t+i+2, teacher-forced: the chain is
  ``drafter.step(h_i, token[t+i+1], i, W_lm)`` with ``h_0 = h0[t]``, exactly the
  call the decode loop's tree builder makes (:func:`head_logits`).
* Loss = sum over heads of ``head_decay ** i`` times the mean cross-entropy, over
  the roots whose label is an assistant token inside the conversation. The label
  is that token (``--labels hard``) or the target's own distribution for it
  (``--labels soft``): ``softmax(W_lm norm(last_hidden[t+i+1]))``, recomputed
  from the cached last hidden state through the frozen final norm and LM head, so
  no logits are stored. ``--regression-weight w`` adds ``w`` times Clover-2's
  SmoothL1 regression of the head's feature onto that same ``last_hidden[t+i+1]``
  (the state from which the target predicts token t+i+2; docs/drafter.md#training).

``--cache`` takes one or more caches separated by commas (ShareGPT plus the
8-category data), or a distilled JSONL, whose hidden states are then computed on
the fly (:class:`training.hidden_cache.LiveFeatures`; no disk). ``--eval-cache``
with ``--eval-every N`` measures teacher-forced top-1 on held-out data every N
steps into ``eval_log.jsonl``: the learning curve against training tokens.

Batches are buckets of conversations of similar length within ``--batch-tokens``
padded tokens; the batch plan depends only on the cache, the seed, the epochs
and ``--max-tokens`` (assistant tokens), never on the method, so Clover and
Medusa trained with the same flags see the same data in the same order.

AdamW (0.9, 0.999), lr 1e-3, short linear warmup then cosine decay, gradient
clipping, 1 epoch by default. ``train_state.pt`` (weights, optimizer, RNG, step)
is written atomically every ``--save-every`` steps; rerunning the same command
resumes and ends with the same weights as an uninterrupted run. The final heads
are saved with :func:`clover.drafters.save_drafter` (fp16) next to
``training_summary.json``.

``--features online`` runs the frozen target inside the training step instead of
reading a cache (:mod:`training.features`): the same hidden states, loss and data
order, no disk. Under ``torchrun --nproc_per_node N`` each process takes its share
of every batch and the gradients are summed over processes
(:mod:`training.distributed`); ``--grad-accum K`` splits each process's share into
K micro-batches. The weights after a step do not depend on N or K (to float
rounding), so a run may resume with another N.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from clover.config import (DRAFTER_METHODS, TOKEN_PATHS, ConfigError, DrafterConfig,
                           resolve_feature_layers)
from clover.drafters import (DRAFT_VOCAB_FILE, Drafter, calibrate_token_scale, load_drafter,
                             read_draft_vocab, save_drafter, set_draft_vocab)
from training.accuracy import teacher_forced
from training.batches import Batch, assistant_tokens, collate, plan_digest, plan_epochs
from training.distributed import Distributed, end_torchrun_rank
from training.features import (FEATURE_SOURCES, enable_gradient_checkpointing, online_hidden_states,
                               online_target_dtype, peak_memory_mb, stored_dtype)
from training.forward import find_roots, head_weights, pick_device, run_batch
from training.hidden_cache import HiddenCache, open_training_data
from training.run_dir import (EVAL_LOG_FILE, LOG_FILE, STATE_FILE, SUMMARY_FILE, CheckpointClock,
                              Progress, append_json_line, claim_output_on_main, drop_log_lines_after, save_atomic)
from training.train_config import TrainConfig

LABELS = ("hard", "soft")
STATE_VERSION = 1


class Interrupted(Exception):
    """Raised by a step callback to stop a run (tests simulate a kill with it)."""


# ---------------------------------------------------------------------------
# the loop


def lr_at(step: int, total: int, base: float, warmup: int, min_ratio: float,
          decay: tuple[int, int] | None = None, restart: tuple[int, int] | None = None) -> float:
    """The learning rate of 0-based ``step``: linear warmup, then a cosine from ``base`` down to
    ``base * min_ratio`` at the plan's last step. ``decay = (from_step, steps)``: a decay branch leaves that
    schedule at ``from_step`` and anneals, also along a cosine, from its rate there to the same floor in
    ``steps`` steps (docs/drafter.md#training-at-scale-and-exact-resume). ``restart = (start_step, steps)``:
    a continued run's optimizer starts empty at ``start_step``, so its rate climbs linearly to the schedule's
    over ``steps`` steps, as at any start (docs/drafter.md#training-at-scale-and-exact-resume)."""
    if restart is not None and restart[0] <= step < restart[0] + restart[1]:
        return lr_at(step, total, base, warmup, min_ratio, decay) * (step - restart[0] + 1) / restart[1]
    if decay is not None and step >= decay[0]:
        start, floor = lr_at(decay[0], total, base, warmup, min_ratio), base * min_ratio
        done = min(1.0, (step - decay[0] + 1) / decay[1])  # 1 at the branch's last step: the floor
        return floor + (start - floor) * 0.5 * (1 + math.cos(math.pi * done))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_drafter(cfg: TrainConfig, target) -> Drafter:
    tc = target.config
    decoder_heads = cfg.decoder_heads or tc.num_heads
    if tc.hidden_size % decoder_heads:
        decoder_heads = 1
    config = DrafterConfig(method=cfg.method, num_heads=cfg.num_heads, hidden_size=tc.hidden_size,
                           vocab_size=tc.vocab_size, target_num_layers=tc.num_layers,
                           num_attention_heads=decoder_heads, init_noise_std=cfg.init_noise_std,
                           target_architecture=tc.architecture, token_path=cfg.token_path,
                           feature_layers=resolve_feature_layers(cfg.feature_layers, tc.num_layers))
    drafter = Drafter.from_target(config, target, seed=cfg.seed).float()
    if cfg.init:
        _load_init_weights(drafter, cfg.init, target)
    if cfg.draft_vocab:
        set_draft_vocab(drafter, read_draft_vocab(cfg.draft_vocab, cfg.draft_vocab_size))
    return drafter


def _load_init_weights(drafter: Drafter, directory: str, target) -> None:
    """Start from trained heads (``--init``): same method and shape, checked against the target's fingerprint.

    Only the weights are taken; the draft vocabulary is the run's own (``--draft-vocab``), since the heads'
    parameters do not depend on it (their LM head is the target's, docs/drafter.md#draft-vocabulary).
    """
    start = load_drafter(directory, target, draft_vocab_size=0)
    if (start.config.method, start.config.num_heads) != (drafter.config.method, drafter.config.num_heads):
        raise ConfigError(f"--init {directory}: {start.config.num_heads} {start.config.method} heads, but this run "
                          f"trains {drafter.config.num_heads} {drafter.config.method} heads")
    try:
        drafter.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    except RuntimeError as exc:
        raise ConfigError(f"--init {directory}: its weights do not fit this run's heads ({exc})") from exc


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


class Trainer:
    """The drafter, its optimizer and the frozen pieces that one training step needs."""

    def __init__(self, cfg: TrainConfig, target, device: torch.device, dist: Distributed | None = None) -> None:
        self.cfg, self.target, self.device, self.dist = cfg, target, device, dist or Distributed()
        self.drafter = build_drafter(cfg, target).to(device)
        self.drafter.train()
        if cfg.grad_checkpoint:
            enable_gradient_checkpointing(self.drafter)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.lm_head_weight = target.lm_head.weight.detach().float().to(device)  # [V, H], frozen
        self.weights = head_weights(cfg.num_heads, cfg.head_decay)

    def step(self, batches: list[Batch], lr: float, prepare=None) -> tuple[dict, float]:
        """One optimizer step at learning rate ``lr`` over this process's micro-batches of one plan batch.

        run_batch divides head i's loss by its label count; each micro-batch's head-i weight is scaled by
        its share of the head-i labels of the whole batch on every process, so the summed gradient is the
        one of a single process on the whole batch (training/distributed.py). ``prepare(batch)`` fills a
        micro-batch's hidden states just before it runs (online features). Returns the whole batch's
        loss, label counts and top-1 hits per head, and the gradient norm.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        k = self.cfg.num_heads
        local = [find_roots(batch, k).valid.sum(0).tolist() for batch in batches]  # [micro][head]
        total = self.dist.sum(torch.tensor([sum(c[i] for c in local) for i in range(k)], dtype=torch.float64,
                                           device=self.device)).tolist()
        summed = torch.zeros(1 + 2 * k, dtype=torch.float64)
        for batch, counts in zip(batches, local):
            shares = [w * (c / t) if t else 0.0 for w, c, t in zip(self.weights, counts, total)]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16"):
                part = run_batch(self.drafter, self.target, self.lm_head_weight, prepare(batch) if prepare else batch,
                                 row_chunk=self.cfg.row_chunk, weights=shares, train=True, labels=self.cfg.labels,
                                 regression_weight=self.cfg.regression_weight, topk_weight=self.cfg.topk_weight,
                                 topk_tokens=self.cfg.topk_tokens)
            summed += torch.tensor([part["loss"], *part["count"], *part["hits"][1]], dtype=torch.float64)
        summed = self.dist.sum(summed.to(self.device)).cpu()
        self.dist.sum_gradients(self.params)
        stats = {"loss": float(summed[0]), "count": [int(x) for x in summed[1: 1 + k]],
                 "hits": {1: [int(x) for x in summed[1 + k:]]}}
        grad_norm = float("nan")  # not measured without clipping
        if self.cfg.grad_clip:
            grad_norm = float(nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.optimizer.step()
        return stats, grad_norm

    def save_state(self, path: Path, progress: Progress, elapsed: float, plan_digest: str) -> None:
        """Write everything the next step depends on; the data position is the step (the plan is rebuilt from
        the data and the settings, and ``plan_digest`` checks it is the same plan on resume)."""
        save_atomic({"version": STATE_VERSION, "resume_key": self.cfg.resume_key(), "step": progress.step,
                     "tokens": progress.tokens_seen, "elapsed": elapsed, "drafter": self.drafter.state_dict(),
                     "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                     "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
                     "plan_digest": plan_digest}, path)

    def load_state(self, path: Path, plan_digest: str) -> Progress:
        """Restore a checkpoint (weights, optimizer, RNG) if ``path`` holds one; the progress it had reached."""
        if not path.exists():
            return Progress()
        state = torch.load(path, map_location="cpu", weights_only=False)  # RNG state must stay on CPU
        if state.get("version") != STATE_VERSION or state.get("resume_key") != self.cfg.resume_key():
            raise ConfigError(f"{path} belongs to another run; use another --output or delete it")
        if state.get("plan_digest", plan_digest) != plan_digest:  # checkpoints from before the digest: trusted
            raise ConfigError(f"{path}: the training data changed since this run started (another batch plan); "
                              "use another --output, or restore the data")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return Progress(state["step"], state["tokens"], state["elapsed"])


def train(cfg: TrainConfig, target=None, on_step=None) -> dict:
    """Run (or resume) training; returns the summary dict. ``on_step(step)`` runs after each step.

    Under torchrun (``WORLD_SIZE`` > 1), or in a process group the caller made, this is one rank of a
    data-parallel job (:mod:`training.distributed`); rank 0 writes every file. With ``--features
    online`` a given ``target`` is moved to the device and dtype online features run in.
    """
    _check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    dist = Distributed.from_env(device.type)
    try:
        summary = _train_rank(cfg, target, on_step, out, dist, dist.device(device))
        # no rank tears the group down while another is still in the last collective (gloo aborted the
        # process then, under load: "terminate called without an active exception")
        dist.barrier()
        return summary
    finally:
        dist.close()


def _check_config(cfg: TrainConfig) -> None:
    if cfg.method not in DRAFTER_METHODS:
        raise ConfigError(f"unknown method {cfg.method!r}; choose one of {', '.join(DRAFTER_METHODS)}")
    if cfg.autocast not in (None, "bf16"):
        raise ConfigError(f"autocast {cfg.autocast!r}: use bf16 or leave it unset")
    if cfg.labels not in LABELS:
        raise ConfigError(f"labels {cfg.labels!r}: use one of {', '.join(LABELS)}")
    if cfg.features not in FEATURE_SOURCES:
        raise ConfigError(f"features {cfg.features!r}: use one of {', '.join(FEATURE_SOURCES)}")
    if cfg.grad_accum < 1:
        raise ConfigError("--grad-accum must be at least 1")
    if cfg.decay_from is not None and cfg.decay_steps < 1:
        raise ConfigError("a decay branch needs decay_steps of at least 1")


def _train_rank(cfg: TrainConfig, target, on_step, out: Path, dist: Distributed, device: torch.device) -> dict:
    online = cfg.features == "online"
    if target is None:
        from clover.demo import resolve_target
        from clover.target import load_target

        directory = resolve_target(cfg.target)
        target = load_target(directory, dtype=online_target_dtype(cfg.target_dtype, device, stored_dtype(directory))
                             if online else torch.float32)
    cache = open_training_data(cfg.cache, target, capture_layers=_capture_layers(cfg, target), tokens_only=online)
    cache.check_target(target)
    if online:  # the frozen target runs in the step: on this rank's device (a no-op for a target loaded above)
        dtype = online_target_dtype(cfg.target_dtype, device, target.lm_head.weight.dtype)
        target = target.to(device=device, dtype=dtype)
    else:  # the rest stays on the CPU; soft labels and the regression target read the final norm on the device
        target.norm.to(device)
    finished = claim_output_on_main(cfg, out, dist)
    if finished is not None:
        return finished

    plan, epoch_ends = plan_epochs(cache.conversations, cfg.batch_tokens, cfg.epochs, cfg.seed, cfg.bucket_size,
                                   cfg.max_tokens)
    trainer = Trainer(cfg, target, device, dist)
    if cfg.token_path == "scaled" and not cfg.init:  # the learned token scale starts at the data's root-state norm
        calibrate_token_scale(trainer.drafter, _root_state_sample(cache))
    progress = trainer.load_state(out / STATE_FILE, plan_digest(plan))
    if progress.step < cfg.start_step:  # a continuation's first start: the --init heads saw plan[:start_step]
        progress = continued_progress(cfg, cache, plan)
    if dist.is_main:
        drop_log_lines_after(out / LOG_FILE, progress.step)
        drop_log_lines_after(out / EVAL_LOG_FILE, progress.step)
    _run_steps(trainer, cache, plan, progress, out, on_step, _LearningCurve(cfg, trainer, out, epoch_ends))
    if progress.step < cfg.final_step(len(plan)):  # paused by --stop-at: the checkpoint holds the run
        return {"complete": False, "method": cfg.method, "steps": progress.step, "planned_steps": len(plan),
                "assistant_tokens": progress.tokens_seen, "wall_time_s": round(progress.elapsed, 1)}
    summary = None
    if dist.is_main:
        save_drafter(trainer.drafter.cpu().eval(), out, dtype=torch.float16)
        if cfg.draft_vocab:  # the whole ranking, counts and provenance: the heads use its first draft_vocab_size ids
            shutil.copyfile(Path(cfg.draft_vocab) / DRAFT_VOCAB_FILE, out / DRAFT_VOCAB_FILE)
        summary = _summary(cfg, cache, plan, progress, device, out / LOG_FILE, dist.world_size)
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return dist.broadcast(summary)


def continued_progress(cfg: TrainConfig, cache, plan: list[list[int]]) -> Progress:
    """Where a run continued from earlier heads (``--continue-from``) starts: after the batches those heads
    saw, which must be this plan's first ``start_step`` (their summary's digest of them; for heads written before
    the digest, the answer tokens in them)."""
    seen = plan[:cfg.start_step]
    tokens = answer_tokens(cache, seen)
    earlier = read_training_summary(Path(cfg.init))
    same = (earlier["trained_batches_digest"] == plan_digest(seen) if "trained_batches_digest" in earlier
            else earlier.get("assistant_tokens") == tokens)
    if not same:
        raise ConfigError(f"--continue-from {cfg.init}: its heads did not train on this run's first {cfg.start_step} "
                          "batches: another data file, seed or batch plan (--batch-tokens, --epochs, --bucket-size)")
    return Progress(cfg.start_step, tokens, 0.0)


def answer_tokens(cache, batches: list[list[int]]) -> int:
    """The assistant (loss) tokens in these batches of conversation indices."""
    return int(sum(assistant_tokens(cache.conversations[i]) for batch in batches for i in batch))


def read_training_summary(heads_dir: Path) -> dict:
    path = heads_dir / SUMMARY_FILE
    if not path.exists():
        raise ConfigError(f"{heads_dir}: no {SUMMARY_FILE}, so the data its heads saw is unknown (heads that "
                          "train.py or decay_branch.py wrote have one)")
    return json.loads(path.read_text())


def _capture_layers(cfg: TrainConfig, target) -> tuple[int, ...]:
    """The target layers whose inputs the heads read (multi-layer features); () for the last layer's input."""
    return tuple(resolve_feature_layers(cfg.feature_layers, target.config.num_layers) or ())


def _root_state_sample(cache, conversations: int = 8) -> torch.Tensor:
    """The target's last hidden states ``[N, H]`` at the answer positions of the first conversations: the
    root states h0 at initialisation (the Augmenting Block starts as a copy of the last layer)."""
    states = []
    for i in range(min(conversations, len(cache.conversations))):
        conv = cache.conversation(i)
        mask = np.asarray(conv["assistant_mask"], dtype=bool)
        states.append(torch.from_numpy(np.array(conv["last_hidden"], dtype=np.float32)[mask]))
    return torch.cat(states)


def _run_steps(trainer: Trainer, cache: HiddenCache, plan: list[list[int]], progress: Progress, out: Path,
               on_step, curve: "_LearningCurve") -> None:
    """Train from ``progress.step`` to the end of ``plan``: log, checkpoint and show progress as configured.

    Every rank runs every step on its share of the batch; only rank 0 writes (log, checkpoint, curve).
    """
    from clover.progress import progress_bar

    cfg, total_steps, main = trainer.cfg, len(plan), trainer.dist.is_main
    # --stop-at pauses the run at a step (equal-data comparisons, a session's end) without changing its schedule:
    # the learning rate follows the whole plan, so the weights there are those of the unbroken run
    end = min(cfg.final_step(total_steps), cfg.stop_at or total_steps)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(100, round(0.03 * total_steps)))
    feeder = _Feeder(cfg, cache, trainer)
    checkpoints = CheckpointClock(cfg.save_every, 60 * cfg.save_minutes)
    digest = plan_digest(plan)
    window: list[dict] = []  # the last 20 steps, for the progress bar
    bar = progress_bar(total=total_steps, initial=progress.step, unit="step", enabled=cfg.progress and main,
               dynamic_ncols=True, desc=cfg.method)
    t0, memory = time.monotonic(), 0.0  # memory: peak MB since the last log line
    while progress.step < end:
        lr = lr_at(progress.step, total_steps, cfg.lr, warmup, cfg.min_lr_ratio, cfg.decay, cfg.restart)
        stats, grad_norm = trainer.step(feeder.micro_batches(plan[progress.step]), lr, feeder.prepare)
        memory = max(memory, peak_memory_mb(trainer.device))
        progress.step += 1
        progress.tokens_seen += answer_tokens(cache, [plan[progress.step - 1]])
        top1 = [h / c if c else 0.0 for h, c in zip(stats["hits"][1], stats["count"])]
        window = (window + [{"loss": stats["loss"], "top1": top1}])[-20:]
        _show_progress(bar, window, cfg.num_heads, progress.tokens_seen)
        step, elapsed = progress.step, progress.elapsed + (time.monotonic() - t0)
        if step % cfg.log_every == 0 or step == total_steps:
            memory = trainer.dist.max(memory, trainer.device)  # the largest rank's
            if main:
                append_json_line(out / LOG_FILE, {"step": step, "tokens": progress.tokens_seen, "lr": lr,
                                                  "loss": stats["loss"], "top1": top1, "grad_norm": grad_norm,
                                                  "max_memory_mb": memory, "elapsed_s": round(elapsed, 2)})
            memory = 0.0
        curve.maybe_measure(step, total_steps, progress.tokens_seen)  # before the checkpoint that covers its line
        if main and (checkpoints.due(step, total_steps) or step == end):
            trainer.save_state(out / STATE_FILE, progress, elapsed, digest)
            checkpoints.written()
        if on_step is not None:
            on_step(step)
    bar.close()
    progress.elapsed += time.monotonic() - t0


class _Feeder:
    """This process's micro-batches of one plan batch (:meth:`Distributed.micro_batches`), with the hidden
    states the drafter needs: read from the cache by :func:`collate`, or computed by the target in
    :meth:`prepare` just before the micro-batch runs (``--features online``)."""

    def __init__(self, cfg: TrainConfig, cache: HiddenCache, trainer: Trainer) -> None:
        self.cfg, self.cache, self.trainer = cfg, cache, trainer
        self.need_input = trainer.drafter.augment is not None  # the Augmenting Block runs on the last layer's input
        self.need_last = not self.need_input or cfg.needs_target_hidden
        self.online = cfg.features == "online"
        self.capture_layers = _capture_layers(cfg, trainer.target)

    def micro_batches(self, indices: list[int]) -> list[Batch]:
        read = not self.online
        return [collate(self.cache, share, self.need_input and read, self.need_last and read, self.trainer.device)
                for share in self.trainer.dist.micro_batches(indices, self.cfg.grad_accum) if share]

    def prepare(self, batch: Batch) -> Batch:
        if not self.online:
            return batch
        x_in, x_last = online_hidden_states(self.trainer.target, batch.tokens, self.need_input, self.need_last,
                                            self.capture_layers)
        return dataclasses.replace(batch, x_in=x_in, x_last=x_last)


class _LearningCurve:
    """Teacher-forced accuracy and loss on held-out data every ``eval_every`` steps, and with ``eval_epochs`` at
    each epoch's end (where the heads are also kept, in ``epoch-K/``), into ``eval_log.jsonl``.

    The proxy for tokens per step against training tokens (training/README.md#learning-curve); the epoch
    points choose how many epochs pay (docs/drafter.md#training-at-scale). It reads the weights and changes
    nothing, so a resumed run still ends bit for bit the same.
    """

    def __init__(self, cfg: TrainConfig, trainer: "Trainer", out: Path, epoch_ends: list[int]) -> None:
        self.cfg, self.trainer, self.out, self.path = cfg, trainer, out, out / EVAL_LOG_FILE
        self.epoch_of_end = {end: epoch + 1 for epoch, end in enumerate(epoch_ends)} if cfg.eval_epochs else {}
        wanted = cfg.eval_cache and (cfg.eval_every > 0 or cfg.eval_epochs) and trainer.dist.is_main
        self.cache = open_training_data(cfg.eval_cache, trainer.target, capture_layers=_capture_layers(
            cfg, trainer.target)) if wanted else None

    def _due(self, step: int, total_steps: int) -> bool:
        every = self.cfg.eval_every > 0 and (step % self.cfg.eval_every == 0 or step == total_steps)
        return every or step in self.epoch_of_end

    def maybe_measure(self, step: int, total_steps: int, tokens: int) -> None:
        if self.cache is None or not self._due(step, total_steps):
            return
        cfg, drafter = self.cfg, self.trainer.drafter
        result = teacher_forced(drafter, self.trainer.target, self.cache, device=self.trainer.device,
                                max_conversations=cfg.eval_conversations, row_chunk=cfg.row_chunk,
                                loss={"labels": cfg.labels, "regression_weight": cfg.regression_weight,
                                      "topk_weight": cfg.topk_weight, "topk_tokens": cfg.topk_tokens})
        drafter.train()
        line = {"step": step, "tokens": tokens, **{k: result["overall"][k] for k in ("top1", "top5", "agree1", "loss")
                                                   if k in result["overall"]}}
        if step in self.epoch_of_end:
            line["epoch"] = self.epoch_of_end[step]
            save_drafter(copy.deepcopy(drafter).cpu().eval(), self.out / f"epoch-{line['epoch']}", dtype=torch.float16)
        append_json_line(self.path, line)


def _show_progress(bar, window: list[dict], num_heads: int, tokens_seen: int) -> None:
    mean_top1 = [sum(w["top1"][i] for w in window) / len(window) for i in range(num_heads)]
    bar.update(1)
    bar.set_postfix(loss=f"{sum(w['loss'] for w in window) / len(window):.3f}",
                    top1="/".join(f"{a:.2f}" for a in mean_top1), tok=tokens_seen)


def _summary(cfg: TrainConfig, cache: HiddenCache, plan: list[list[int]], progress: Progress, device: torch.device,
             log_path: Path, world_size: int = 1) -> dict:
    """``training_summary.json`` of a completed run; final loss and top-1 are means over its last 10 log lines.
    A decay branch is complete at its own last step: ``steps`` of the plan's ``planned_steps`` batches."""
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    recent = lines[-10:]
    trained = plan[:progress.step]
    return {
        "complete": True,
        "method": cfg.method,
        "num_heads": cfg.num_heads,
        "steps": len(trained),
        "planned_steps": len(plan),  # as in a paused run's summary
        "assistant_tokens": progress.tokens_seen,
        "planned_assistant_tokens": answer_tokens(cache, trained),
        "trained_batches_digest": plan_digest(trained),  # which batches: --continue-from checks it
        "max_tokens": cfg.max_tokens,
        "epochs": cfg.epochs,
        "wall_time_s": round(progress.elapsed, 1),
        "hardware": _hardware(device),
        "processes": world_size,
        "max_memory_mb": max((r.get("max_memory_mb", 0.0) for r in lines), default=None),  # of any rank
        "torch": torch.__version__,
        "final_loss": sum(r["loss"] for r in recent) / len(recent) if recent else None,
        "final_top1": [sum(r["top1"][i] for r in recent) / len(recent) for i in range(cfg.num_heads)] if recent else None,
        **_epoch_choice(log_path.parent / EVAL_LOG_FILE),
        "cache": {"path": str(cfg.cache), "conversations": len(cache), "tokens": cache.index["num_tokens"],
                  "source": cache.index.get("source", "")},
        "target_fingerprint": cache.index["target_fingerprint"],
        "config": dataclasses.asdict(cfg),
        "command": _command_line(),
    }


def _command_line() -> str | None:
    """The training/ command that ran (train.py, or decay_branch.py for a branch); None when called otherwise."""
    script = Path(sys.argv[0]) if sys.argv else None
    if script is None or script.parent.name != "training":
        return None
    return f"python -m training.{script.stem} " + " ".join(sys.argv[1:])


def _epoch_choice(eval_log: Path) -> dict:
    """The held-out loss at each epoch's end (``--eval-epochs``) and the epoch where it is lowest: the
    epoch count to keep (its heads are in ``epoch-K/``; docs/drafter.md#training-at-scale)."""
    lines = [json.loads(line) for line in eval_log.read_text().splitlines() if line] if eval_log.exists() else []
    epochs = {r["epoch"]: r["loss"] for r in lines if "epoch" in r and "loss" in r}
    if not epochs:
        return {}
    return {"eval_loss_by_epoch": epochs, "best_epoch": min(epochs, key=epochs.get)}


def _add_head_options(parser: argparse.ArgumentParser, fields: dict) -> None:
    """The options that shape the heads themselves: vocabulary, starting weights, token path, features."""
    parser.add_argument("--draft-vocab", metavar="DIR", default=None,
                        help="score only a draft vocabulary V' in the heads' LM head, as the engine's draft step "
                             "does (FR-Spec): the --draft-vocab-size most frequent ids of DIR's "
                             "draft_vocab.safetensors (training/draft_vocab.py writes one). The soft label is then "
                             "the target's distribution over V'; about V/V' times less LM-head work per step. "
                             "The heads are saved with that vocabulary. Default: the full vocabulary")
    parser.add_argument("--draft-vocab-size", type=int, default=fields["draft_vocab_size"].default,
                        help="V' with --draft-vocab (default %(default)s)")
    parser.add_argument("--init", metavar="DIR", default=None,
                        help="start from these trained heads (a directory save_drafter or a run wrote, e.g. "
                             "clover/assets/smollm2-135m-instruct/clover) instead of a fresh initialisation: "
                             "fine-tuning on new data. Same method and number of heads; the run's own "
                             "--draft-vocab applies. Default: a fresh initialisation")
    parser.add_argument("--continue-from", metavar="DIR", default=None,
                        help="go on with heads that an earlier run of this same recipe and data wrote (e.g. the "
                             "shipped clover/assets/smollm2-135m-instruct/clover, whose training_summary.json says "
                             "how many steps they saw): start from their weights at that step of the plan, on the "
                             "batches they have not seen, with a fresh optimizer whose rate climbs back over "
                             "--rewarm-steps (docs/drafter.md#training-at-scale-and-exact-resume). For sessions that keep "
                             "only shipped heads, not checkpoints; a checkpoint resumes exactly instead")
    parser.add_argument("--rewarm-steps", type=int, default=20,
                        help="with --continue-from: steps of linear warmup for the fresh optimizer (default %(default)s)")
    parser.add_argument("--token-path", choices=TOKEN_PATHS, default="residual",
                        help="how the regressive step mixes its given token into the state (docs/drafter.md#token-"
                             "path): residual (the paper's: h + gate * Wv e, e unit-norm), normed (the same on the "
                             "RMS-normalised state, e at RMS 1), scaled (residual with e times a learned scalar "
                             "initialised to the median root-state norm), concat (EAGLE-style FC([norm(h); e]))")
    parser.add_argument("--feature-layers", default=None, metavar="eagle3|L1,L2,...",
                        help="multi-layer features (EAGLE-3; docs/drafter.md#multi-layer-features): the Augmenting "
                             "Block reads a learned fusion of these target layers' inputs instead of the last "
                             "layer's input alone; eagle3: a low, a middle and the last layer. Needs --features "
                             "online or a .jsonl --cache; every backend and engine runs such heads")


# the help of the numeric options (each also shows its default)
NUMBER_OPTIONS_HELP = {
    "num_heads": "draft heads: the deepest a draft tree goes (head i proposes the token i+1 places ahead)",
    "decoder_heads": "attention heads of the Attention Decoder (default: the target's; 1 where the hidden size does "
                     "not divide)",
    "save_every": "steps between checkpoints (also --save-minutes); a rerun resumes from the last one",
    "log_every": "steps between lines of the training log (train_log.jsonl)",
    "epochs": "passes over the training data",
    "max_tokens": "assistant tokens to train on in all, the plan's length (default: every token of every epoch)",
    "batch_tokens": "padded tokens per step: the global batch, over all torchrun processes",
    "bucket_size": "conversations sorted by length together before batching (less padding; the order stays random)",
    "row_chunk": "roots per chunk of the LM-head loss: bounds the memory of the vocabulary-sized logits",
    "seed": "random seed: the heads' initialisation and the data order",
    "warmup_steps": "steps of linear learning-rate warmup (default: 3%% of the steps, at least 1, at most 100)",
    "threads": "CPU threads of torch (default: torch's choice)",
    "topk_tokens": "K of the top-K distillation loss (--topk-weight)",
    "lr": "peak learning rate of AdamW, reached after the warmup, then a cosine decay to lr * --min-lr-ratio",
    "beta1": "AdamW's beta1",
    "beta2": "AdamW's beta2",
    "weight_decay": "AdamW's weight decay",
    "min_lr_ratio": "the learning rate at the plan's last step, as a fraction of --lr",
    "grad_clip": "clip the gradient's global norm to this",
    "head_decay": "loss weight of head i is head_decay ** i: the deeper heads count less",
    "init_noise_std": "standard deviation of the noise the fresh heads are initialised with",
    "regression_weight": "Clover-2's SmoothL1 regression of each head's feature onto the target's hidden state, "
                         "weighted against the cross-entropy's 1 (0: off)",
    "topk_weight": "HASS top-K distillation beside the cross-entropy, weighted against its 1 (0: off)",
    "save_minutes": "also checkpoint when this many minutes have passed since the last checkpoint",
}


def _add_number_options(parser: argparse.ArgumentParser, fields: dict) -> None:
    """--num-heads, --lr, ...: one option per numeric TrainConfig field of NUMBER_OPTIONS_HELP."""
    for name in ("num_heads", "decoder_heads", "save_every", "log_every", "epochs", "max_tokens", "batch_tokens",
                 "bucket_size", "row_chunk", "seed", "warmup_steps", "threads", "topk_tokens"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=fields[name].default,
                            help=_number_help(name, fields[name].default))
    for name in ("lr", "beta1", "beta2", "weight_decay", "min_lr_ratio", "grad_clip", "head_decay", "init_noise_std",
                 "regression_weight", "topk_weight", "save_minutes"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=fields[name].default,
                            help=_number_help(name, fields[name].default))


def _number_help(name: str, default) -> str:
    return NUMBER_OPTIONS_HELP[name] + ("" if default is None else " (default %(default)s)")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", metavar="JSON",
                     help="a JSON file of option values (names as in TrainConfig, e.g. \"batch_tokens\"): the "
                          "defaults, which the command line overrides; it may give the required options too")
    known, _ = pre.parse_known_args(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    parser.add_argument("--method", choices=DRAFTER_METHODS, required=True,
                        help="the heads to train: clover (the paper's), clover2 (Clover-2), medusa, or an ablation "
                             "of Clover (docs/drafter.md)")
    parser.add_argument("--cache", required=True,
                        help="hidden-state cache directory (train split); several separated by commas; a distilled "
                             ".jsonl computes the hidden states on the fly instead (no disk); with --features online "
                             "only its tokens are read")
    parser.add_argument("--output", required=True, help="run directory: checkpoints, then the final heads")
    parser.add_argument("--target", default="demo", help="checkpoint directory or 'demo' (only its LM head and shape are used)")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    _add_number_options(parser, fields)
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="pause after this step: checkpoint there and exit without the final heads (e.g. to "
                             "compare methods at equal data, or to end a session). The learning rate still follows "
                             "the whole plan, so rerunning without it (or with a later step) continues exactly")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between learning-curve points (eval_log.jsonl)")
    parser.add_argument("--eval-conversations", type=int, default=200, help="held-out conversations per curve point")
    parser.add_argument("--eval-cache", default=None,
                        help="held-out data for the learning curve: a hidden-state cache, or a distilled .jsonl "
                             "(hidden states computed on the fly)")
    parser.add_argument("--eval-epochs", action="store_true",
                        help="also measure the curve at each epoch's end and keep those heads in epoch-K/: the "
                             "epoch count is then chosen from the held-out loss (eval_log.jsonl, the summary)")
    parser.add_argument("--labels", choices=LABELS, default="hard",
                        help="hard: the text's next token; soft: the target's distribution (from the cached last "
                             "hidden state through the frozen norm and LM head)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (GPU when present)")
    parser.add_argument("--autocast", choices=("bf16",), default=None,
                        help="bf16 mixed precision (fp32 weights and loss, bf16 matmuls): several times faster "
                             "on GPUs and on CPUs with AMX or AVX512-BF16, slow on other CPUs")
    parser.add_argument("--features", choices=FEATURE_SOURCES, default="cache",
                        help="cache: read the target's hidden states from --cache; online: run the frozen target in "
                             "each step on the batch's tokens (inference mode; bf16/fp16 on GPU, fp32 on CPU), the "
                             "same loss and data order with no cache on disk (give --cache a distilled .jsonl)")
    parser.add_argument("--target-dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="--features online: the target's dtype; auto: fp32 on CPU, on GPU the checkpoint's "
                             "own bf16/fp16")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per process per step: each step is still one batch of --batch-tokens "
                             "(the global batch, over all torchrun processes), in less memory")
    parser.add_argument("--grad-checkpoint", action="store_true",
                        help="recompute the Augmenting Block in the backward pass instead of storing its "
                             "activations (less memory, one more block forward)")
    _add_head_options(parser, fields)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the log lines stay)")
    if known.config:
        defaults = json.loads(Path(known.config).read_text())
        unknown = sorted(set(defaults) - set(fields))
        if unknown:
            parser.error(f"{known.config}: unknown keys {unknown}")
        parser.set_defaults(**defaults)
        for action in parser._actions:  # a config file may supply required options
            if action.dest in defaults:
                action.required = False
    args = parser.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["progress"] = not args.no_progress
    if args.continue_from:
        if args.init:
            parser.error("--continue-from already starts from its heads; drop --init")
        try:
            start_step = read_training_summary(Path(args.continue_from))["steps"]
        except ConfigError as exc:
            parser.error(f"--continue-from: {exc}")
        values.update(init=args.continue_from, start_step=start_step)
    values["rewarm_steps"] = args.rewarm_steps if args.continue_from else 0
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        summary = train(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun the same command to resume from the last checkpoint in {cfg.output}",
              file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") == "0":  # torchrun: one summary line, from rank 0
        keys = ("method", "steps", "assistant_tokens", "wall_time_s", "final_loss", "final_top1")
        print(json.dumps({k: summary[k] for k in keys if k in summary}))
        if not summary["complete"]:
            print(f"paused at step {summary['steps']} of {summary['planned_steps']} (--stop-at); rerun without it, "
                  f"or with a later step, to go on", file=sys.stderr)
    return end_torchrun_rank(0)


if __name__ == "__main__":
    sys.exit(main())
