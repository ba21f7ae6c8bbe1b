"""The settings of one training run (``python -m training.train``'s options), apart from the loop that reads them.

It sits below training/train.py and training/run_dir.py (which checks a resumed run's settings against the saved
ones): both import it, and it imports neither.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TrainConfig:
    method: str
    cache: str
    output: str
    target: str = "demo"
    num_heads: int = 3
    decoder_heads: int | None = None      # Attention Decoder heads; None: the target's attention heads
    init_noise_std: float = 0.01
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    warmup_steps: int | None = None       # None: 3% of the steps, at least 1, at most 100
    min_lr_ratio: float = 0.0
    epochs: int = 1
    max_tokens: int | None = None         # assistant-token budget; None: all epochs
    batch_tokens: int = 4096              # padded tokens per batch
    bucket_size: int = 256                # conversations sorted by length together
    row_chunk: int = 1024                 # roots per LM-head chunk (memory bound)
    grad_clip: float = 1.0
    head_decay: float = 1.0               # loss weight of head i: head_decay ** i
    labels: str = "hard"                  # "soft": the target's distribution (recomputed from last_hidden)
    regression_weight: float = 0.0        # Clover-2 SmoothL1 feature regression, relative to the CE's weight 1
    topk_weight: float = 0.0              # HASS top-K distillation beside the CE, relative to the CE's weight 1
    topk_tokens: int = 10                 # K of the top-K distillation loss
    autocast: str | None = None           # "bf16": mixed precision (fp32 weights, bf16 matmuls; fast on AMX/GPU)
    seed: int = 0
    save_every: int = 20
    save_minutes: float = 5.0             # also checkpoint when this long has passed since the last one
    log_every: int = 10
    device: str = "auto"
    threads: int | None = None
    progress: bool = True
    eval_cache: str | None = None         # held-out cache for the learning curve (eval_log.jsonl)
    eval_every: int = 0                   # steps between curve points; 0: none
    eval_conversations: int = 200         # held-out conversations per curve point
    eval_epochs: bool = False             # also a curve point, and the heads in epoch-K/, at each epoch's end
    features: str = "cache"               # "online": the target runs inside the step (training/features.py)
    target_dtype: str = "auto"            # online: auto = fp32 on CPU, the checkpoint's bf16/fp16 on GPU
    grad_accum: int = 1                   # micro-batches per process per step (same weights, less memory)
    grad_checkpoint: bool = False         # recompute the Augmenting Block in the backward pass
    draft_vocab: str | None = None        # heads directory whose draft_vocab.safetensors the heads score (FR-Spec)
    draft_vocab_size: int = 16384         # V': that many most frequent ids of it
    init: str | None = None               # heads directory to start from (fine-tuning) instead of a fresh init
    token_path: str = "residual"          # how the regressive step mixes in its token (DrafterConfig.token_path)
    feature_layers: str | None = None     # multi-layer features: "eagle3" or "l1,l2,..." (DrafterConfig.feature_layers)
    stop_at: int | None = None            # pause after this step (checkpoint, no final heads); the schedule is the plan's
    decay_from: int | None = None         # a decay branch (training/decay_branch.py) anneals from this step ...
    decay_steps: int = 0                  # ... to the floor (min_lr_ratio) over this many steps
    start_step: int = 0                   # --continue-from: the plan's step the --init heads reached (data skipped) ...
    rewarm_steps: int = 0                 # ... and the steps the fresh optimizer's rate climbs back to the plan's over

    # fields that may differ between a run and its resumption (none changes the weights beyond float rounding)
    RESUME_FREE = ("save_every", "save_minutes", "log_every", "device", "threads", "progress", "output", "cache", "target",
                   "eval_cache", "eval_every", "eval_conversations", "eval_epochs", "features", "target_dtype", "grad_accum",
                   "grad_checkpoint", "stop_at")

    @property
    def restart(self) -> tuple[int, int] | None:
        """``(start_step, rewarm_steps)`` of a run continued from earlier heads, else None (:func:`lr_at`)."""
        return (self.start_step, max(1, self.rewarm_steps)) if self.start_step else None

    @property
    def decay(self) -> tuple[int, int] | None:
        """``(from_step, steps)`` of a decay branch, else None (:func:`lr_at`)."""
        return None if self.decay_from is None else (self.decay_from, self.decay_steps)

    def final_step(self, plan_steps: int) -> int:
        """The step after which the run is finished and writes its heads: a decay branch's last step (its
        learning rate is at the floor there), else the plan's last."""
        return plan_steps if self.decay_from is None else min(plan_steps, self.decay_from + self.decay_steps)

    @property
    def needs_target_hidden(self) -> bool:
        """Whether the loss reads the target's last hidden state at the label positions."""
        return self.labels == "soft" or self.regression_weight > 0 or self.topk_weight > 0

    def resume_key(self) -> dict:
        key = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUME_FREE}
        if self.draft_vocab is None:  # full vocabulary: the key of runs from before --draft-vocab existed
            del key["draft_vocab"], key["draft_vocab_size"]
        if self.init is None:  # likewise for runs from before --init
            del key["init"]
        if self.token_path == "residual":  # likewise for runs from before --token-path
            del key["token_path"]
        if not self.topk_weight:  # likewise for runs from before --topk-weight
            del key["topk_weight"], key["topk_tokens"]
        if not self.feature_layers:  # likewise for runs from before --feature-layers
            del key["feature_layers"]
        if self.decay_from is None:  # likewise for runs that are not decay branches
            del key["decay_from"], key["decay_steps"]
        if not self.start_step:  # likewise for runs that are not continuations
            del key["start_step"], key["rewarm_steps"]
        return key
