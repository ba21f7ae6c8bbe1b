#!/usr/bin/env python
"""Time to first token through the OpenAI-compatible frontend: its cost over direct gRPC, and a burst.

``--burst N``: N greedy streams sent at once (the prompts, each ``--copies`` times, in turn), after each prompt
was sent alone once (its solo answer and first-token time); per burst the first stream's, the median and the last
first-token time, the wall time until all N answers are in, and how many answers equal their solo answer token for
token (docs/serving.md#first-tokens-under-a-burst). Without it:

Paired runs against one running ``clover serve --openai-port``: each pair sends the same greedy
streaming request once through tritonclient's gRPC stream and once through the ``openai`` client
(order alternating between pairs), and the difference of the two first-token times is the frontend's
cost for that pair. The first token is the first response carrying token ids on either path (the
``return_token_ids`` extension), so text held back by the detokenizer does not count.

Usage::

    clover serve --engine ENGINE --openai-port 9000 &
    python -m benchmarks.openai_ttft --grpc-url localhost:8001 --openai-url http://localhost:9000/v1
    python -m benchmarks.openai_ttft --openai-url http://localhost:9000/v1 --burst 32 --bursts 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from clover.client import GrpcClient


def grpc_ttft(client: GrpcClient, prompt: str, max_tokens: int) -> float:
    start = time.perf_counter()
    first = None
    for chunk in client.stream(prompt, max_tokens):  # read to the end, like the OpenAI stream
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    return first


def openai_stream(client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[int], float]:
    """(seconds to the first token, the answer's token ids, seconds to the end) of one greedy streamed chat
    request."""
    start = time.perf_counter()
    first, ids = None, []
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    for chunk in stream:
        new = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
        if new and first is None:
            first = time.perf_counter() - start
        ids += new or []
    return first, ids, time.perf_counter() - start


def openai_ttft(client, model: str, prompt: str, max_tokens: int) -> float:
    return openai_stream(client, model, prompt, max_tokens)[0]


def burst(client, model: str, prompts: list[str], max_tokens: int) -> tuple[float, list[tuple]]:
    """All ``prompts`` streamed at once, one thread each, released together; (wall seconds, each stream's
    :func:`openai_stream` result) in the order of ``prompts``."""
    results: list = [None] * len(prompts)
    gate = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        gate.wait()
        results[i] = openai_stream(client, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    gate.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, results


def burst_summary(wall: float, results: list[tuple], solo: list[list[int]]) -> dict:
    """``solo``: each stream's solo answer, to compare with."""
    firsts = sorted(first for first, _, _ in results)
    median = statistics.median(firsts)
    return {"streams": len(results), "first_stream_ttft_s": round(firsts[0], 3), "median_ttft_s": round(median, 3),
            "last_ttft_s": round(firsts[-1], 3), "median_over_last": round(median / firsts[-1], 3),
            "wall_s": round(wall, 3), "equal_to_solo": sum(ids == want for (_, ids, _), want in zip(results, solo)),
            "output_tokens": sum(len(ids) for _, ids, _ in results), "ttfts_s": [round(first, 3) for first in firsts],
            "ends_s": sorted(round(end, 3) for _, _, end in results)}


COUNTERS = ("clover_batch_steps_total", "clover_sequence_steps_total", "clover_draft_tokens_total",
            "clover_accepted_draft_tokens_total")


def read_counters(metrics_url: str | None) -> dict[str, float]:
    """The model's step and draft counters from Triton's ``/metrics`` (nothing without a URL)."""
    if not metrics_url:
        return {}
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.split("{")[0] in COUNTERS}


def run_bursts(client, args) -> dict:
    """Warm-up requests, each prompt alone once (its solo answer and first-token time), then the bursts."""
    from clover.bench import PROMPTS

    prompts = [line for line in open(args.prompts_file).read().splitlines() if line] if args.prompts_file else PROMPTS
    for _ in range(args.warmup):
        openai_stream(client, args.model, prompts[0], args.max_tokens)
    solo = {p: openai_stream(client, args.model, p, args.max_tokens) for p in prompts}
    sent = [prompts[i % len(prompts)] for i in range(args.burst)]
    bursts = []
    for _ in range(args.bursts):
        before = read_counters(args.metrics_url)
        wall, results = burst(client, args.model, sent, args.max_tokens)
        bursts.append(burst_summary(wall, results, [solo[p][1] for p in sent]))
        after = read_counters(args.metrics_url)  # the server's counters over this burst alone
        bursts[-1]["server_counters"] = {name.removeprefix("clover_").removesuffix("_total"): after[name] - before[name]
                                         for name in after}
    solo_ttfts = [first for first, _, _ in solo.values()]
    summary = {"prompts": len(prompts), "max_tokens": args.max_tokens,
               "solo_ttft_s": {"median": round(statistics.median(solo_ttfts), 3), "min": round(min(solo_ttfts), 3),
                               "max": round(max(solo_ttfts), 3)}, "bursts": bursts}
    for one in bursts:
        one["first_stream_over_solo"] = round(one["first_stream_ttft_s"] / summary["solo_ttft_s"]["median"], 2)
    return summary


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
    parser.add_argument("--burst", type=int, default=0, help="streams sent at once (0: the paired runs instead)")
    parser.add_argument("--bursts", type=int, default=2, help="with --burst: bursts, one after the other")
    parser.add_argument("--metrics-url", help="with --burst: Triton's metrics, e.g. http://localhost:8002/metrics, "
                        "for the model's step and draft counters over each burst")
    parser.add_argument("--prompts-file", help="with --burst: one prompt a line (default: clover.bench's 8 prompts)")
    args = parser.parse_args()
    import openai

    # a long timeout: a burst's slow streams are measured, not cut
    oai = openai.OpenAI(base_url=args.openai_url, api_key="unused", max_retries=0, timeout=3600.0)
    if args.burst:
        print(json.dumps(run_bursts(oai, args), indent=2))
        return
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
