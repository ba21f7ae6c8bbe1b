"""The torch reference backend (CPU or CUDA).

:class:`TargetStep` and :class:`DraftStep` are plain ``nn.Module`` wrappers
with the contract's positional tensors, so the same modules are what the ONNX
exporter traces.

:class:`TorchEngine` runs where the target's weights are. On a GPU it follows the TensorRT backend's
convention: the KV cache lives on the device (``EngineSpec.device``), the small inputs are copied in, and
logits, ``h0`` and the draft outputs come back to the host for the decode loop
(scripts/gpu_check.py checks it against transformers ``generate()``: docs/status.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from clover.config import ConfigError
from clover.drafters import Drafter, draft_vocab_of
from clover.engine_contract import DraftPrefillResult, DraftResult, EngineSpec, TargetResult
from clover.methods import method_traits
from clover.target import LlamaTarget
from clover.tensor_parallel import Shard, gather_logits, shard_target, token_rows, vocab_rows

logger = logging.getLogger(__name__)


class TargetStep(nn.Module):
    """Target plus Augmenting Block (a fork beside the last layer, with its own KV layer)."""

    def __init__(self, target: LlamaTarget, drafter: Drafter | None = None) -> None:
        super().__init__()
        self.target = target
        self.augment = drafter.augment if drafter is not None else None
        self.feature_fuse = drafter.feature_fuse if self.augment is not None else None  # multi-layer features
        self.feature_layers = tuple(drafter.config.feature_layers or ()) if self.augment is not None else ()

    @property
    def num_kv_layers(self) -> int:
        return self.target.config.num_layers + (self.augment is not None)

    def forward(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        """Shapes as in :meth:`clover.engine_contract.Engine.target`."""
        num_layers = self.target.config.num_layers
        out = self.target(input_ids, position_ids, past_lengths, packed_mask, k_cache[:num_layers], v_cache[:num_layers],
                          self.feature_layers)
        present_keys, present_values = out.present_keys, out.present_values
        if self.augment is None:
            h0 = out.last_hidden
        else:
            cos, sin = self.target.rope(position_ids)
            features = out.last_layer_input
            if self.feature_fuse is not None:
                features = self.feature_fuse(torch.cat(out.layer_inputs, dim=-1))
            h0, pk, pv = self.augment(features, cos, sin, past_lengths, packed_mask,
                                      k_cache[num_layers], v_cache[num_layers])
            present_keys, present_values = [*present_keys, pk], [*present_values, pv]
        return TargetResult(out.logits, h0, present_keys, present_values)


class DraftStep(nn.Module):
    """One draft step with the top-k taken inside, so full logits never leave it.

    With a draft vocabulary (the drafter's ``draft_vocab``, FR-Spec: docs/drafter.md#draft-vocabulary) the
    heads score only those V' rows of the LM head, kept as their own ``[V', H]`` tensor; the top-k is taken
    over them (log-probabilities normalised over the V' tokens) and mapped back to target token ids.
    """

    def __init__(self, target: LlamaTarget, drafter: Drafter, top_k: int) -> None:
        super().__init__()
        self.drafter = drafter
        self.lm_head = target.lm_head
        self.top_k = top_k
        vocab = draft_vocab_of(drafter)  # [V'] target ids, or None: the full vocabulary
        if vocab is not None and len(vocab) < top_k:
            raise ConfigError(f"a draft vocabulary of {len(vocab)} tokens cannot give the top {top_k}")
        self.register_buffer("draft_vocab", vocab, persistent=False)
        rows = None if vocab is None else vocab_rows(target.lm_head, vocab).clone()  # [V', H], whole on every rank
        self.register_buffer("draft_lm_head", rows, persistent=False)

    def forward(self, hidden, token, head) -> DraftResult:
        """hidden ``[N, H]``, token int64 ``[N]``, head int64 scalar."""
        # tensor parallel: the token rows gathered, this rank's vocabulary scored, the logits gathered
        # (clover.tensor_parallel); a whole LM head passes through unchanged
        weights, token = token_rows(self.lm_head, token)
        scored = self.lm_head.weight if self.draft_vocab is None else self.draft_lm_head
        next_hidden, logits = self.drafter.step(hidden, token, head, weights, scored)
        if self.draft_vocab is None:
            logits = gather_logits(self.lm_head, logits)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V or V']
        top = torch.topk(logprobs, self.top_k, dim=-1)
        ids = top.indices if self.draft_vocab is None else self.draft_vocab[top.indices]
        return DraftResult(next_hidden, top.values, ids)


class DraftPrefill(nn.Module):
    """Contract v2's ``draft_prefill``: the drafter's own Augmenting Block over newly accepted positions."""

    def __init__(self, target: LlamaTarget, drafter) -> None:
        super().__init__()
        self.drafter = drafter
        self.lm_head = target.lm_head

    def forward(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> DraftPrefillResult:
        """Shapes as in the ``draft_prefill`` comment of :class:`clover.engine_contract.Engine`."""
        weights, next_token = token_rows(self.lm_head, next_token)  # the prefill reads W_lm[next_token] only
        state, present_keys, present_values = self.drafter.prefill(
            hidden, next_token, position_ids, past_lengths, packed_mask, k_cache, v_cache, weights)
        return DraftPrefillResult(state, present_keys, present_values)


def _kv_layers_of(heads) -> list[nn.Module]:
    """The heads' decoder layers with KV caches shaped as the target's (split with it under tensor parallel)."""
    if heads is None:
        return []
    return [*([heads.augment] if heads.augment is not None else []), *getattr(heads, "block", [])]


class TorchEngine:
    """Runs the two contract callables eagerly with torch."""

    def __init__(self, target: LlamaTarget, drafter: Drafter | None = None, max_seq_len: int = 2048,
                 draft_top_k: int = 8) -> None:
        cfg = target.config
        self.device = target.lm_head.weight.device
        if drafter is not None and next(drafter.parameters()).device != self.device:
            raise ConfigError(f"the drafter is on {next(drafter.parameters()).device}, the target on {self.device}: "
                              "move both to one device")
        self.checkpoint_dir: Path | None = None  # set by from_checkpoint
        self.cost_model = None  # step times for adaptive trees: calibrate_cost_model()
        self.target_step = TargetStep(target, drafter).eval()
        self.draft = DraftStep(target, drafter, draft_top_k).eval() if drafter is not None else None
        has_prefill = drafter is not None and drafter.has_draft_prefill
        self.prefill_step = DraftPrefill(target, drafter).eval() if has_prefill else None
        self.spec = EngineSpec(
            num_kv_layers=self.target_step.num_kv_layers,
            num_kv_heads=target.layers[0].self_attn.num_kv_heads,  # this rank's under tensor parallelism
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_seq_len=min(max_seq_len, cfg.max_position_embeddings),
            draft_top_k=draft_top_k,
            num_draft_heads=drafter.config.num_heads if drafter is not None else 0,
            drafter_method=drafter.config.method if drafter is not None else None,
            num_draft_kv_layers=drafter.num_kv_layers if has_prefill else 0,
            dtype=target.lm_head.weight.dtype,
            device=str(self.device),
        )

    @classmethod
    def from_checkpoint(cls, target: str | Path | None = "demo", drafter: str | None = None, method: str = "clover",
                        max_seq_len: int = 2048, cache_dir: str | Path | None = None,
                        draft_top_k: int = 8, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, shard: Shard | None = None) -> "TorchEngine":
        """The engine of a Hugging Face checkpoint (``demo``: the embedded one) and its heads.

        ``drafter`` as :func:`clover.demo.resolve_drafter` reads it: None on the demo target means its shipped
        heads of ``method``'s family; no heads found means untrained ones (lossless, little speed-up).
        ``method="vanilla"`` or ``"suffix"`` (the model-free proposer alone) loads no heads. The checkpoint directory is kept as ``checkpoint_dir``
        (its tokenizer: :func:`clover.target.load_tokenizer`). ``device``, ``dtype``: where the weights run, and in
        what precision (bf16 on a GPU: docs/gpu-engine.md#precision). ``shard``: this rank's slice of a
        tensor-parallel target (its process group up: clover.lockstep.join, docs/serving.md#tensor-parallel).
        """
        from clover.demo import resolve_drafter, resolve_target
        from clover.drafters import load_drafter
        from clover.target import load_target

        path = resolve_target(None if target is None else str(target), cache_dir)
        model = load_target(path)
        heads = None
        if method_traits(method).uses_heads:
            drafter_dir = resolve_drafter(drafter, None if target is None else str(target), method)
            if drafter_dir is not None:
                heads = load_drafter(drafter_dir, model)
            else:
                logger.warning("using untrained %s heads (output is unchanged, speed-up needs trained heads)",
                               method)
                heads = Drafter.untrained(model, method)
        model = model.to(device=device, dtype=dtype)
        heads = heads.to(device=device, dtype=dtype) if heads is not None else None
        if shard is not None and shard.world_size > 1:
            shard_target(model, shard, _kv_layers_of(heads))
        engine = cls(model, heads, max_seq_len=max_seq_len, draft_top_k=draft_top_k)
        engine.checkpoint_dir = Path(path)
        return engine

    def calibrate_cost_model(self, max_tokens: int, repeats: int = 3, retries: int = 2):
        """Time this engine's steps (seconds on a CPU) and keep the cost model, so adaptive trees work on the
        torch path too: there is no engine directory to store one in (docs/trees.md#adaptive-tree-budget)."""
        from clover.adaptive import calibrate

        self.cost_model = calibrate(self, max_tokens=max_tokens, repeats=repeats, source="torch, measured at load",
                                    retries=retries)
        return self.cost_model

    @property
    def _on_host(self) -> bool:
        return self.device.type == "cpu"

    def _to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(self.device, non_blocking=True) for t in tensors]

    @torch.inference_mode()
    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        if self._on_host:  # no copies: the CPU path's host work per step is measured (docs/trees.md#host-work-per-step)
            return self.target_step(input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache)
        out = self.target_step(*self._to_device(input_ids, position_ids, past_lengths, packed_mask), k_cache, v_cache)
        return TargetResult(out.logits.float().cpu(), out.h0.cpu(), out.present_keys, out.present_values)

    @torch.inference_mode()
    def draft_step(self, hidden, token, head: int) -> DraftResult:
        if self.draft is None:
            raise RuntimeError("this engine has no drafter; use method 'vanilla' or pass --drafter")
        if self._on_host:
            return self.draft(hidden, token, head)
        out = self.draft(*self._to_device(hidden, token), head)
        return DraftResult(*(t.cpu() for t in out))

    @torch.inference_mode()
    def draft_prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_cache,
                      v_cache) -> DraftPrefillResult:
        if self.prefill_step is None:
            raise RuntimeError("this engine's drafter keeps no KV cache (engine contract v1): no draft_prefill")
        if self._on_host:
            return self.prefill_step(hidden, next_token, position_ids, past_lengths, packed_mask, k_cache, v_cache)
        inputs = self._to_device(hidden, next_token, position_ids, past_lengths, packed_mask)
        out = self.prefill_step(*inputs, k_cache, v_cache)
        return DraftPrefillResult(out.state.cpu(), out.present_keys, out.present_values)
