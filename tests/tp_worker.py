"""One rank of the tensor-parallel checks in tests/test_tensor_parallel.py (``python -m tests.tp_worker``).

Every rank builds the same random tiny Llama with 3 KV heads (not divisible by 2: split 2 + 1) and its own
slice of it; rank 0 drives a :class:`~clover.lockstep.LockstepDecoder` per case, the others follow, and rank 0
writes each case's outputs and the whole target's greedy reference as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.decode import GenerationRequest
from clover.lockstep import LockstepDecoder, join, leave
from clover.rendezvous import Rendezvous
from clover.tensor_parallel import shard_target
from tests.helpers import random_prompts
from tests.random_models import make_drafter, make_target

MAX_NEW = 24
# (name, method, tree, prompts, joining later[, max_step_tokens]): batch 1 and 4, suffix candidates or none,
# requests that join, a step cap that admits the prompts one or two a step
CASES = [
    ("vanilla-1", "vanilla", TreeConfig(), 1, 0),
    ("vanilla-4", "vanilla", TreeConfig(), 4, 0),
    ("clover-1", "clover", TreeConfig(), 1, 0),
    ("clover-4", "clover", TreeConfig(), 4, 0),
    ("clover-heads-only-4", "clover", TreeConfig(proposer="none"), 4, 0),
    ("suffix-4", "suffix", TreeConfig(), 4, 0),
    ("clover-joins", "clover", TreeConfig(), 4, 2),
    ("clover-capped-4", "clover", TreeConfig(), 4, 0, 24),
]


def tiny_models():
    """The whole target (6 query heads, 3 KV heads) and heads; prompts with repeats, so suffix candidates hit."""
    target = make_target(seed=3, num_heads=6, num_kv_heads=3, head_dim=8, hidden_size=48)
    drafter = make_drafter(target, randomize=False)  # the paper's init: accepts some drafts
    prompts = random_prompts(7, 4, target.config.vocab_size, 4, 12)
    prompts = [p + p for p in prompts]
    return target, drafter, prompts


def run_case(decoder: LockstepDecoder, prompts: list[list[int]], joining: int) -> list[list[int]]:
    """Greedy outputs; ``joining`` of the prompts are submitted after the first three steps (in-flight joins)."""
    def request(prompt):
        return GenerationRequest(prompt, max_new_tokens=MAX_NEW, stop_token_ids=())

    outputs: dict[int, list[int]] = {}

    def take(events):
        for event in events:
            outputs.setdefault(event.seq_id, []).extend(event.new_token_ids)

    def step():  # first tokens through on_prefill, as the server's batcher takes them (the followers: no callback)
        take(decoder.step(on_prefill=take))

    ids = [decoder.submit(request(p)) for p in prompts[: len(prompts) - joining]]
    for _ in range(3 if joining else 0):
        step()
    ids += [decoder.submit(request(p)) for p in prompts[len(prompts) - joining:]]
    while decoder.has_work:
        step()
    return [outputs[i] for i in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shard = join(Rendezvous(2, "127.0.0.1", args.port), args.rank)
    target, drafter, prompts = tiny_models()
    whole_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    shard_target(target, shard, [drafter.augment])
    engine = TorchEngine(target, drafter, max_seq_len=256)
    results = {"outputs": {}, "prompts": prompts}
    for name, method, tree, count, joining, *cap in CASES:
        if args.rank:
            LockstepDecoder(engine).follow()
            continue
        decoder = LockstepDecoder(engine, method, tree, max_step_tokens=cap[0] if cap else None)
        results["outputs"][name] = run_case(decoder, prompts[:count], joining)
        decoder.release()
    results["rank0_bytes"], results["whole_bytes"] = sum(
        p.numel() * p.element_size() for p in target.parameters()), whole_bytes
    leave(tell_followers=False)  # each case released them already
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
