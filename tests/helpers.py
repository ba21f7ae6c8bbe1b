"""Test engines and reference decoding used by several test files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from clover.backends.device import DeviceEngine
from clover.backends.torch import TorchEngine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.engine_contract import DraftPrefillResult, DraftResult, TargetResult


class OracleEngine:
    """Wraps a torch engine with a drafter that proposes the vanilla continuation.

    It follows the engine contract honestly: ``target`` runs the real target and
    stores each sequence's index in one extra KV layer (``[..., 0]`` of the
    key), so the id survives cache compaction; ``h0`` carries (sequence,
    position). ``draft_step`` then looks up the vanilla greedy token at the
    next position as its top-1 (log-prob 0) and fills the rest of its top-k
    with other tokens at -20.
    """

    def __init__(self, inner: TorchEngine, prompts: list[list[int]], continuations: list[list[int]],
                 num_heads: int = 3, top_k: int = 4) -> None:
        self.inner = inner
        self.full = [p + c for p, c in zip(prompts, continuations)]
        self.prompts = [tuple(p) for p in prompts]
        spec = inner.spec
        self.spec = dataclasses.replace(spec, num_kv_layers=spec.num_kv_layers + 1, num_draft_heads=num_heads,
                                        drafter_method="clover", draft_top_k=top_k)

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        res = self.inner.target(input_ids, position_ids, past_lengths, packed_mask, k_cache[:-1], v_cache[:-1])
        batch, tokens = input_ids.shape
        seq_ids = []
        for b in range(batch):
            if int(past_lengths[b]) == 0:  # prefill: identify by the prompt
                row = input_ids[b].tolist()
                matching = [i for i, p in enumerate(self.prompts) if len(p) <= tokens and tuple(row[: len(p)]) == p]
                seq_ids.append(max(matching, key=lambda i: len(self.prompts[i])))
            else:
                seq_ids.append(int(k_cache[-1][b, 0, 0, 0]))
        h0 = torch.zeros(batch, tokens, self.spec.hidden_size)
        h0[..., 0] = torch.tensor(seq_ids, dtype=h0.dtype)[:, None]
        h0[..., 1] = position_ids.float()
        if res.present_keys is None:  # an in-place inner engine (contract v3): so is the marker layer
            for b, (seq, past) in enumerate(zip(seq_ids, past_lengths.tolist())):
                k_cache[-1][b, :, past : past + tokens] = seq
                v_cache[-1][b, :, past : past + tokens] = seq
            return TargetResult(res.logits, h0, None, None)
        # the marker layer lives where the inner engine's presents do (the GPU for a CUDA engine), h0 on the host
        marker = torch.tensor(seq_ids, dtype=res.present_keys[0].dtype, device=res.present_keys[0].device)
        shape = res.present_keys[0].shape
        present_marker = marker[:, None, None, None].expand(shape).contiguous()
        return TargetResult(res.logits, h0, [*res.present_keys, present_marker], [*res.present_values, present_marker])

    def draft_step(self, hidden, token, head) -> DraftResult:
        n, k = hidden.shape[0], self.spec.draft_top_k
        ids = torch.zeros(n, k, dtype=torch.long)
        for i in range(n):
            seq, pos = int(hidden[i, 0]), int(hidden[i, 1])
            full = self.full[seq]
            right = full[pos + 2] if pos + 2 < len(full) else 0
            others = [t for t in range(self.spec.vocab_size) if t != right][: k - 1]
            ids[i] = torch.tensor([right, *others])
        logprobs = torch.full((n, k), -20.0)
        logprobs[:, 0] = 0.0
        next_hidden = hidden.clone()
        next_hidden[:, 1] += 1
        return DraftResult(next_hidden, logprobs, ids)


class Clover2OracleEngine(OracleEngine):
    """:class:`OracleEngine` with contract v2's ``draft_prefill`` (method ``clover2``).

    ``draft_prefill`` passes the target's (sequence, position) h0 through as each position's state and
    writes the token that follows each position into its one-layer draft cache (``[..., 0]`` of the key).
    On every call it checks the draft cache it is given: a row's ``past`` committed positions must hold
    exactly the tokens 1..past of its sequence, and the first new position must be ``past`` followed by
    the sequence's next token. So a draft commit or a compaction that loses, repeats or misplaces a
    position fails the decode that uses the oracle, not only a later comparison.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spec = dataclasses.replace(self.spec, drafter_method="clover2", num_draft_kv_layers=1)
        self.draft_prefill_calls = 0

    def draft_prefill(self, hidden, next_token, position_ids, past_lengths, packed_mask, k_cache,
                      v_cache) -> DraftPrefillResult:
        self.draft_prefill_calls += 1
        for b in range(next_token.shape[0]):
            seq, past = int(hidden[b, 0, 0]), int(past_lengths[b])
            full = self.full[seq]
            assert k_cache[0][b, 0, :past, 0].long().tolist() == full[1: past + 1], "draft cache rows out of step"
            assert int(position_ids[b, 0]) == past and int(hidden[b, 0, 1]) == past
            assert int(next_token[b, 0]) == full[past + 1]
        shape = (*next_token.shape[:1], self.spec.num_kv_heads, next_token.shape[1], self.spec.head_dim)
        present = next_token.to(torch.float32)[:, None, :, None].expand(shape).contiguous()
        return DraftPrefillResult(hidden.clone(), [present], [present])


class DeviceOracleEngine(DeviceEngine):
    """:class:`OracleEngine` for the device step (docs/gpu-engine.md): a drafter that proposes the vanilla
    continuation, written as tensor ops so the step stays on the device.

    A prefill (the pass at position 0) finds its sequence by the prompt it starts with and stores the index in
    one extra KV layer; every pass reads it back from there and sends (sequence, position) as ``h0``;
    ``draft_step`` looks up the continuation at the next position in a table, as its top-1 (log-prob 0), the
    rest of its top-k at -20.
    """

    def __init__(self, target, prompts: list[list[int]], continuations: list[list[int]], num_heads: int = 3,
                 top_k: int = 4, max_seq_len: int = 128) -> None:
        super().__init__(target, None, max_seq_len=max_seq_len)
        full = [list(p) + list(c) for p, c in zip(prompts, continuations)]
        width = max_seq_len + 2
        self.table = torch.tensor([f + [0] * (width - len(f)) for f in full], device=self.device)
        longest = max(len(p) for p in prompts)
        self.prompt_table = torch.tensor([list(p) + [-1] * (longest - len(p)) for p in prompts], device=self.device)
        self.prompt_lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        self.draft = self.device_draft  # the step drafts when the engine has a draft
        self.spec = dataclasses.replace(self.spec, num_kv_layers=self.spec.num_kv_layers + 1,
                                        num_draft_heads=num_heads, drafter_method="clover", draft_top_k=top_k)

    def _prompt_index(self, input_ids):
        """int64 ``[B]``: the longest prompt each row starts with (a prefill's rows)."""
        width = min(input_ids.shape[1], self.prompt_table.shape[1])
        same = (input_ids[:, None, :width] == self.prompt_table[None, :, :width]) | (self.prompt_table[None, :, :width] < 0)
        starts = same.all(-1) & (self.prompt_lengths[None, :] <= input_ids.shape[1])  # [B, P]
        return torch.where(starts, self.prompt_lengths[None, :], -1).argmax(-1)

    def device_target(self, input_ids, position_ids, attention, k_cache, v_cache):
        logits, _ = super().device_target(input_ids, position_ids, attention, k_cache[:-1], v_cache[:-1])
        marker = k_cache[-1]
        prefill = (position_ids[:, 0] == 0)[:, None, None, None]
        marker.copy_(torch.where(prefill, self._prompt_index(input_ids)[:, None, None, None].to(marker.dtype), marker))
        h0 = torch.zeros(*input_ids.shape, self.spec.hidden_size, device=self.device)
        h0[..., 0] = marker[:, 0, 0, 0][:, None]
        h0[..., 1] = position_ids.float()
        return logits, h0

    def device_draft(self, hidden, token, head: int) -> DraftResult:
        k = self.spec.draft_top_k
        seq, position = hidden[:, 0].long(), hidden[:, 1].long()
        right = self.table[seq, (position + 2).clamp(max=self.table.shape[1] - 1)]  # [N]
        others = torch.arange(k - 1, device=self.device)[None, :]
        others = others + (others >= right[:, None])  # the first k - 1 tokens that are not the right one
        logprobs = torch.full((len(seq), k), -20.0, device=self.device)
        logprobs[:, 0] = 0.0
        next_hidden = hidden.clone()
        next_hidden[:, 1] += 1
        return DraftResult(next_hidden, logprobs, torch.cat([right[:, None], others], 1))


def vanilla_greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Clover's own vanilla greedy decoding, each prompt alone (batch 1).

    Not an independent reference: it runs through the same :class:`SpeculativeDecoder` and
    ``greedy_accept`` as the speculative methods; compare outputs with :func:`hf_greedy`.
    """
    decoder = SpeculativeDecoder(engine, "vanilla")
    return [decoder.generate([GenerationRequest(p, max_new_tokens=max_new_tokens, stop_token_ids=())])[0].token_ids
            for p in prompts]


def random_prompts(seed: int, count: int, vocab: int, min_len: int = 1, max_len: int = 20) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def naive_tree_attention(q, k, v, k_cache, v_cache, past_lengths, visible):
    """Per-token loop reference, independent of clover.attention's vectorised code.

    visible: bool [B, T, T] (unpacked mask).
    """
    batch, tokens, q_heads, dim = q.shape
    group = q_heads // k.shape[2]
    out = torch.zeros(batch, tokens, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        past = int(past_lengths[b])
        for t in range(tokens):
            for h in range(q_heads):
                kv = h // group
                keys = [k_cache[b, kv, j] for j in range(past)] + [k[b, j, kv] for j in range(tokens) if visible[b, t, j]]
                vals = [v_cache[b, kv, j] for j in range(past)] + [v[b, j, kv] for j in range(tokens) if visible[b, t, j]]
                if not keys:
                    continue
                keys, vals = torch.stack(keys).double(), torch.stack(vals).double()
                weights = torch.softmax(keys @ q[b, t, h].double() / dim**0.5, dim=0)
                out[b, t, h] = weights @ vals
    return out


# -- the independent greedy reference: transformers generate() ------------------------------------------

_HF_MODELS: dict = {}
_HF_GREEDY: dict = {}


def _target_fingerprint(target) -> str:
    """Content hash of a clover ``LlamaTarget`` (config and every weight): a cache key that follows mutations."""
    digest = hashlib.sha1(json.dumps(target.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(target.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _hf_from_target(target, dtype: torch.dtype):
    """A transformers model with a clover ``LlamaTarget``'s configuration and weights (for ``make_target``)."""
    import transformers

    cfg = target.config
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.architecture == "qwen2":  # Qwen2: q/k/v bias, no o bias, head_dim = hidden / heads
        assert cfg.qkv_bias and not cfg.o_bias and not cfg.mlp_bias
        assert cfg.head_dim * cfg.num_heads == cfg.hidden_size
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        assert cfg.architecture == "llama" and cfg.qkv_bias == cfg.o_bias, cfg
        config = transformers.LlamaConfig(**common, head_dim=cfg.head_dim, attention_bias=cfg.qkv_bias,
                                          mlp_bias=cfg.mlp_bias)
        cls = transformers.LlamaForCausalLM
    model = cls(config)
    state = {name if name == "lm_head.weight" else f"model.{name}": tensor
             for name, tensor in target.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary_emb" not in m], (missing, unexpected)
    return model.to(dtype)


def hf_model(source, dtype: torch.dtype = torch.float32):
    """A transformers causal LM in eval mode for ``source`` (cached).

    ``source``: a Hugging Face checkpoint directory, loaded by ``AutoModelForCausalLM`` from its own
    ``config.json`` (the reference follows the checkpoint, not clover's reading of it: tied embeddings, RoPE,
    biases, norm epsilon); or a clover ``LlamaTarget`` built in memory (``make_target``), copied into the
    transformers model of the same architecture and shape. Its generation config is plain greedy decoding
    with no EOS: :func:`hf_greedy` cuts at stop tokens itself.
    """
    return _hf_model_and_key(source, dtype)[0]


def _hf_model_and_key(source, dtype: torch.dtype):
    import transformers

    if isinstance(source, (str, Path)):
        key = ("checkpoint", str(Path(source).resolve()), dtype)
    else:
        key = ("target", _target_fingerprint(source), dtype)
    if key not in _HF_MODELS:
        if key[0] == "checkpoint":
            model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
        else:
            model = _hf_from_target(source, dtype)
        model.generation_config = transformers.GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None,
                                                                pad_token_id=0)
        _HF_MODELS[key] = model.eval().requires_grad_(False)
    return _HF_MODELS[key], key


@torch.inference_mode()
def hf_greedy(source, prompts: list[list[int]], max_new_tokens: int, stop_token_ids=(),
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Independent reference: transformers ``generate()`` (greedy, its own KV cache), one prompt at a time.

    Each output has ``max_new_tokens`` tokens, or ends at (and includes) the first of ``stop_token_ids``,
    as clover's outputs do. ``source`` as in :func:`hf_model`.
    """
    model, key = _hf_model_and_key(source, dtype)
    outputs = []
    for prompt in prompts:
        cached = _HF_GREEDY.get((key, tuple(prompt)), [])
        if len(cached) < max_new_tokens:  # greedy continuations are prefixes of longer ones
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1)
            cached = out[0, ids.shape[1]:].tolist()
            assert len(cached) == max_new_tokens, "generate() stopped early"
            _HF_GREEDY[(key, tuple(prompt))] = cached
        tokens = cached[:max_new_tokens]
        stops = [i for i, t in enumerate(tokens) if t in set(stop_token_ids)]
        outputs.append(tokens[: stops[0] + 1] if stops else tokens)
    return outputs


@torch.inference_mode()
def hf_next_logits(source, prompt: list[int], tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference's logits ``[len(tokens), V]`` (float32) for each of ``tokens`` given the prompt and
    the tokens before it (one full pass, no KV cache)."""
    model = hf_model(source, dtype)
    full = list(prompt) + list(tokens)
    logits = model(torch.tensor([full]), attention_mask=torch.ones(1, len(full), dtype=torch.long)).logits[0]
    return logits[len(prompt) - 1: len(full) - 1].float()


def greedy_deviations(source, prompt: list[int], tokens: list[int],
                      dtype: torch.dtype = torch.float32) -> list[tuple[int, float, float]]:
    """Where ``tokens`` (a greedy continuation of ``prompt`` by some decoder) are not the reference's argmax,
    each judged on its own prefix (teacher forcing, so the whole sequence is checked even after a divergence):
    ``(position, deficit, top-2 gap)`` with deficit = reference max logit - logit of the chosen token."""
    return deviations_from_argmax(hf_next_logits(source, prompt, tokens, dtype), tokens)


def deviations_from_argmax(logits: torch.Tensor, tokens: list[int]) -> list[tuple[int, float, float]]:
    """:func:`greedy_deviations` for given reference logits ``[len(tokens), V]`` (teacher-forced)."""
    logits = logits.float()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    top2 = torch.topk(logits, 2, dim=-1).values
    deficit = top2[:, 0] - chosen
    return [(i, float(deficit[i]), float(top2[i, 0] - top2[i, 1])) for i in range(len(tokens)) if deficit[i] > 0]


# -- the near-tie rule (docs/testing.md#the-near-tie-rule) ----------------------------------------------------

NEAR_TIE = 1e-3  # fp32 logit gap under which a different summation order may flip an argmax (docs/trees.md)


def assert_argmax_up_to_near_ties(logits: torch.Tensor, tokens: list[int], tie: float,
                                  what: str = "") -> list[tuple[int, float, float]]:
    """The near-tie rule, on reference logits ``[len(tokens), V]`` of ``tokens``' own prefixes (teacher forcing,
    so every token is judged, also after a divergence): each token is the reference's argmax, or its logit is
    within ``tie`` of the top one. ``tie`` comes from the decoder's own numeric error (``NEAR_TIE`` for fp32
    reorderings, twice the fp16 logit error, the int8-activation error), never from a count of exact outputs.
    Returns the deviations ``(position, deficit, top-2 gap)``: the near-ties the decoder resolved otherwise."""
    deviations = deviations_from_argmax(logits, tokens)
    for position, deficit, gap in deviations:
        assert deficit < tie, (f"{what}: token {position} is not the reference's argmax and not a near-tie "
                               f"(logit deficit {deficit:.4g} >= {tie:.4g}, top-2 gap {gap:.4g})")
    return deviations


def full_pass_logits(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``engine``'s target logits ``[len(tokens), V]`` (float32) for each of ``tokens`` on its own prefix: one
    causal pass over prompt + tokens with an empty cache (teacher forcing, as :func:`hf_next_logits`)."""
    from clover.attention import causal_packed_mask

    cfg, full = engine.spec, list(prompt) + list(tokens)
    empty = [torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim, dtype=cfg.dtype)] * cfg.num_kv_layers
    logits = engine.target(torch.tensor([full]), torch.arange(len(full))[None], torch.zeros(1, dtype=torch.int32),
                           causal_packed_mask(1, len(full)), empty, empty).logits
    return logits[0, len(prompt) - 1: len(full) - 1].float()


def assert_argmax_up_to_its_error(error: float, reference_logits: torch.Tensor, tokens: list[int], error_cap: float,
                                  what: str = "") -> list[tuple[int, float, float]]:
    """The near-tie rule for a decoder that is not the reference's arithmetic (fp16, int8 activations), its bound
    derived from that decoder's own error. Where its logits z' are within e of the reference's z, it prefers a
    token t over the reference's argmax a only if z[a] - z[t] <= 2e. ``error`` is e as the caller measured it on
    the engine's passes over the paths judged (:func:`full_pass_logits`, the decode's own logits), plus NEAR_TIE
    for summation orders not measured. e must stay under ``error_cap`` times the logit scale: a decoder that is
    wrong (a RoPE, cache or mask bug) rather than imprecise errs by whole logits and fails here, where the rule
    alone would excuse anything. Returns the deviations."""
    scale = float(reference_logits.abs().max())
    assert error < error_cap * scale, f"{what}: logit error {error:.4g} beyond {error_cap:.3g} of the scale {scale:.3g}"
    return assert_argmax_up_to_near_ties(reference_logits, tokens, 2 * error + NEAR_TIE, what)


def logit_error(engine_logits: torch.Tensor, reference_logits: torch.Tensor) -> float:
    """max |z' - z| (finite logits required)."""
    assert torch.isfinite(engine_logits).all()
    return float((engine_logits.float() - reference_logits.float()).abs().max())


# -- quantized targets: the reference over the weights as stored (docs/quantized-target.md) -----------------


def dequantised_target(source, weights: dict):
    """A copy of the clover ``LlamaTarget`` ``source`` (or of the checkpoint directory ``source``) whose linear
    weights are ``weights`` (``clover.export.target_weights.StoredWeight`` by parameter name) dequantised by
    their own ``dequantize`` (the ``gguf`` package's for Q4_1 / Q8_0), a tied embedding included: what a
    quantized engine means, for :func:`hf_greedy` (transformers) to decode independently of the engine's
    MatMulNBits packing and graph."""
    import copy

    from clover.target import load_target

    target = copy.deepcopy(load_target(source) if isinstance(source, (str, Path)) else source)
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name in weights:
                param.copy_(torch.from_numpy(weights[name].dequantize()))
        if target.config.tie_word_embeddings and "lm_head.weight" in weights:
            target.embed_tokens.weight.copy_(torch.from_numpy(weights["lm_head.weight"].dequantize()))
    return target


def new_kv_of(result, past_lengths, k_cache, v_cache) -> tuple[list, list]:
    """The T new tokens' (keys, values) of a ``target`` call, one ``[B, Hkv, T, D]`` per layer: its presents, or,
    for an engine that wrote them into the caches itself (contract v3, docs/engine-contract.md#in-place-kv),
    each row's cache at ``[past_lengths[b], past_lengths[b] + T)``."""
    if result.present_keys is not None:
        return result.present_keys, result.present_values
    tokens = result.logits.shape[1]

    def written(caches):
        return [torch.stack([c[b, :, p : p + tokens] for b, p in enumerate(past_lengths.tolist())]) for c in caches]

    return written(k_cache), written(v_cache)


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-4) -> None:
    """Equal within ``tolerance`` relative, and absolute ``tolerance`` times the tensor's scale: float32 sums over
    a different order (an ONNX graph against torch) drift with the magnitude of the values summed (the
    Augmenting Block's h0 reaches ~100 on the tiny random targets)."""
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * max(1.0, want.abs().max().item()))


def fake_quantized_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 activations as MatMulNBits' accuracy_level 4 makes them: per block of the weight's block size (32)
    along the inputs, symmetric, scale max|x| / 127, rounded to nearest."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (q * scale).reshape(x.shape)


def int8_compute_reference(reference_target, weights: dict, matmul_nbits: bool = True):
    """transformers' model of ``reference_target`` (the weights dequantised) with each quantized linear's input
    quantized to int8 as above: what int8 compute means (docs/quantized-target.md#compute). ``matmul_nbits``
    (onnxruntime's graph): a Q4_1 weight ``d*(q - 8) + (m + 8d)``, the 4-bit part sees the int8 activations, the
    per-block constant ``m + 8d`` their fp32 block sums (read from the block's own fp16 ``d`` and ``m``). Else
    (the int8-exact kernel, as llama.cpp): the dequantised weight times the int8 activations."""
    model = _hf_from_target(reference_target, torch.float32).eval()

    def hook_for(stored):
        weight = torch.from_numpy(stored.dequantize())  # [N, K]
        offset = None
        if stored.format == "q4_1" and matmul_nbits:
            blocks = stored.data.reshape(stored.shape[0], -1, 20)
            d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
            offset = m + 8 * d  # [N, K/32]
            weight = weight - offset.repeat_interleave(32, dim=1)

        def hook(module, inputs, output):
            x = inputs[0]
            y = fake_quantized_int8(x) @ weight.T
            if offset is not None:
                y = y + x.reshape(*x.shape[:-1], -1, 32).sum(-1) @ offset.T
            return y + module.bias if module.bias is not None else y
        return hook

    for name, module in model.named_modules():
        key = f"{name.removeprefix('model.')}.weight"
        if isinstance(module, torch.nn.Linear) and key in weights:
            module.register_forward_hook(hook_for(weights[key]))
    return model
