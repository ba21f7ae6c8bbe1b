#!/usr/bin/env python
"""Time to first token added by the OpenAI-compatible frontend, over direct gRPC (tritonclient).

Paired runs against one running ``clover serve --openai-port``: each pair sends the same greedy
streaming request once through tritonclient's gRPC stream and once through the ``openai`` client
(order alternating between pairs), and the difference of the two first-token times is the frontend's
cost for that pair. The first token is the first response carrying token ids on either path (the
``return_token_ids`` extension), so text held back by the detokenizer does not count.

Usage::

    clover serve --engine ENGINE --openai-port 9000 &
    python -m benchmarks.openai_ttft --grpc-url localhost:8001 --openai-url http://localhost:9000/v1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from clover.client import GrpcClient


def grpc_ttft(client: GrpcClient, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    for chunk in client.stream(prompt, max_tokens):  # read to the end, like the OpenAI stream
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    return first


def openai_ttft(client, model: str, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].model_extra or {}).get("token_ids"):
            first = time.perf_counter() - start
    return first


def summary(values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {"median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2), "max_ms": round(max(ms), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", default="localhost:8001")
    parser.add_argument("--openai-url", default="http://localhost:9000/v1")
    parser.add_argument("--model", default="clover")
    parser.add_argument("--prompt", default="Explain speculative decoding in two sentences.")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import openai

    oai = openai.OpenAI(base_url=args.openai_url, api_key="unused", max_retries=0)
    direct, frontend = [], []
    with GrpcClient(args.grpc_url, args.model) as grpc:
        paths = {"direct": lambda: grpc_ttft(grpc, args.prompt, args.max_tokens),
                 "openai": lambda: openai_ttft(oai, args.model, args.prompt, args.max_tokens)}
        for _ in range(args.warmup):
            paths["direct"](), paths["openai"]()
        for i in range(args.pairs):
            order = ("direct", "openai") if i % 2 == 0 else ("openai", "direct")  # neither always goes first
            results = {name: paths[name]() for name in order}
            direct.append(results["direct"])
            frontend.append(results["openai"])
    added = [o - d for o, d in zip(frontend, direct)]
    print(json.dumps({"pairs": args.pairs, "max_tokens": args.max_tokens, "direct_grpc_ttft": summary(direct),
                      "openai_ttft": summary(frontend), "added_ttft": summary(added)}, indent=2))


if __name__ == "__main__":
    main()
