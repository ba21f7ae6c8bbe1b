"""Vanilla and the defaults' tok/s on the exact int8 engine with torch's host ops on 2 threads, then on 1:
``python docs/results/trees-one-pass/host_threads.py ENGINE`` (6 MT-bench first turns, 128 tokens, batch 1, the
kernel on 2 threads; each line twice). Why the engine sets torch to one thread (clover/backends/onnxruntime.py)."""

import sys
import time

import torch

from clover.backends import load_engine
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.prompts import encode_prompt, mtbench_first_turns
from clover.target import load_tokenizer

engine = load_engine(sys.argv[1], threads=2)
tokenizer = load_tokenizer(sys.argv[1])
prompts = [encode_prompt(tokenizer, q["prompt"]) for q in mtbench_first_turns(limit=6)]


def tokens_per_s(method: str, tree) -> float:
    decoder = SpeculativeDecoder(engine, method, tree, max_batch_size=1)
    start = time.perf_counter()
    results = decoder.generate([GenerationRequest(p, max_new_tokens=128) for p in prompts])
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


for threads in (2, 1):
    torch.set_num_threads(threads)
    for _ in range(2):
        vanilla, defaults = tokens_per_s("vanilla", None), tokens_per_s("clover", engine.meta.tree_defaults)
        print(f"torch threads {threads}: vanilla {vanilla:.1f} tok/s, defaults {defaults:.1f} tok/s")
