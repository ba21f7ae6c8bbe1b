"""Test engines and reference decoding used by several test files."""

from __future__ import annotations

import torch

import dataclasses

from clover.backends.torch import TorchEngine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.engine import DraftResult, TargetResult


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
        marker = torch.tensor(seq_ids, dtype=res.present_keys[0].dtype)
        shape = res.present_keys[0].shape
        present_marker = marker[:, None, None, None].expand(shape).contiguous()
        h0 = torch.zeros(batch, tokens, self.spec.hidden_size)
        h0[..., 0] = marker[:, None]
        h0[..., 1] = position_ids.float()
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


def vanilla_greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: vanilla greedy decoding, each prompt alone (batch 1)."""
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
