"""``clover`` command line: ``clover generate|serve|client ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from clover.config import PROPOSERS, ConfigError, SamplingConfig, TreeConfig


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with vanilla, Medusa or Clover decoding",
        description="Generate answers with the target model. Greedy output is identical for every method; "
                    "the speculative methods only make it faster.",
        formatter_class=_HelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the answer streams to the terminal")
    src.add_argument("--prompts-file", type=Path, help='JSONL file of {"id": ..., "prompt": ...} lines')
    p.add_argument("--output", type=Path, help="JSONL results for --prompts-file (default: stdout)")
    p.add_argument("--summary", type=Path, help="write totals (new tokens, decode seconds, tokens/s, tokens/step, acceptance rate) as JSON")
    p.add_argument("--target", default="demo", help="Hugging Face checkpoint directory, or 'demo' for the embedded SmolLM2-135M-Instruct")
    p.add_argument("--cache-dir", help="where the demo checkpoint is converted to (default: $CLOVER_CACHE_DIR or ~/.cache/clover)")
    p.add_argument("--engine", type=Path, help="built engine directory (export/build_engine.py); replaces "
                   "--target/--drafter: tokenizer, heads and limits come from its engine.json")
    p.add_argument("--method", choices=["vanilla", "medusa", "clover", "clover2", "suffix"], default=None,
                   help="decoding method (default: the family of the heads in use, clover for the torch path; "
                        "vanilla for an engine without heads); clover2: Clover-2 heads (none are shipped yet: "
                        "untrained ones unless --drafter names trained ones); suffix: no heads, only candidates "
                        "copied from the prompt and the answer so far (any engine, also one without heads)")
    p.add_argument("--proposer", choices=list(PROPOSERS), default=None,
                   help="model-free candidates merged into the heads' tree: suffix (continuations of the longest "
                        "repeated suffix of the prompt and answer), none (the heads alone); default: the engine's "
                        "tree defaults, suffix unless its engine.json says otherwise (docs/trees.md#model-free-candidates)")
    p.add_argument("--drafter", help="trained draft-head directory (config.json + model.safetensors), "
                   "'demo-clover' / 'demo-medusa' (the heads shipped for the demo target, the default there), or "
                   "'untrained' (heads initialised from the target: lossless, little speed-up)")
    p.add_argument("--max-new-tokens", type=_positive, default=256, help="new tokens per prompt at most")
    p.add_argument("--tree-budget", type=int, default=4, help="draft tree nodes per step, not counting the root")
    p.add_argument("--tree-depth", type=int, default=None, help="draft depth (default: every head)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose the tree budget each step (0 to --tree-budget) from the engine's cost model; "
                        "default: whenever the engine has one; --no-adaptive keeps --tree-budget fixed")
    p.add_argument("--backend", choices=["auto", "onnxruntime", "torch"], default="auto",
                   help="auto: the --engine if given; on the demo target with its shipped Clover heads, the demo "
                        "onnxruntime engine (built once into engines/demo, about a minute); else torch. torch: the "
                        "reference path on --target/--drafter")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples (tree speculative sampling)")
    p.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences decoded together at most")
    p.add_argument("--max-seq-len", type=_positive, default=2048, help="KV cache length per sequence")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as is")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch / onnxruntime")
    p.set_defaults(func=cmd_generate)


def _generate_engine_dir(args) -> Path | None:
    """The engine directory ``clover generate`` decodes on, or None for the torch path (see ``--backend``)."""
    if args.engine is not None:
        if args.backend == "torch":
            raise ConfigError("--engine runs on its own backend; drop --backend torch (or --engine)")
        return args.engine
    demo_default = (args.target == "demo" and args.drafter in (None, "demo-clover")
                    and args.method not in ("medusa", "clover2"))
    if args.backend == "torch" or (args.backend == "auto" and not demo_default):
        return None
    if not demo_default:
        raise ConfigError("--backend onnxruntime needs --engine DIR, except on the demo target with its Clover heads")
    from clover.export.builder import ensure_demo_engine

    return ensure_demo_engine(progress=lambda message: print(f"[clover] {message}", file=sys.stderr, flush=True))


def _load_generate_engine(args, tree: TreeConfig):
    """(engine, tokenizer) for ``clover generate``; fills in ``args.method`` from the engine's heads."""
    from clover.target import load_tokenizer

    engine_dir = _generate_engine_dir(args)
    if engine_dir is not None:
        from clover.backends import load_engine

        engine = load_engine(engine_dir, threads=args.threads)
        args.method = args.method or engine.spec.default_method
        return engine, load_tokenizer(engine_dir)
    from clover.backends.torch import TorchEngine

    args.method = args.method or "clover"
    engine = TorchEngine.from_checkpoint(args.target, args.drafter, args.method, args.max_seq_len, args.cache_dir)
    if args.adaptive is not False and args.method != "vanilla" and tree.static_choices is None:
        print("[clover] timing the torch engine's steps for the adaptive tree budget (seconds)", file=sys.stderr)
        engine.calibrate_cost_model(min(256, args.batch_size * (1 + args.tree_budget)))
    return engine, load_tokenizer(engine.checkpoint_dir)


def _stream_to_terminal(decoder, requests, tokenizer, stop: list[str]):
    """Decode one prompt, printing the answer as it grows (cut at a stop string); returns the results."""
    from clover.decode import cut_at_stop

    shown, tokens = [0], []

    def on_event(event):
        tokens.extend(event.new_token_ids)
        text = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)
        sys.stdout.write(text[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(text)

    results = decoder.generate(requests, on_event=on_event)
    sys.stdout.write("\n")
    return results


def _write_results(results, path: Path | None) -> None:
    """One JSON line per answer, to ``path`` or stdout."""
    out = open(path, "w") if path else sys.stdout
    try:
        for r in results:
            out.write(json.dumps({
                "id": r.request_id, "text": r.text, "token_ids": r.token_ids, "num_steps": r.stats.num_steps,
                "new_tokens": len(r.token_ids), "finish_reason": r.finish_reason,
                "tokens_per_step": r.tokens_per_step, "acceptance_per_depth": r.stats.acceptance_per_depth,
            }) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()


def cmd_generate(args) -> int:
    import torch

    from clover.decode import GenerationRequest, SpeculativeDecoder, refuse_empty_prompt
    from clover.prompts import encode_prompt, read_prompts_file

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    tree = TreeConfig(budget=args.tree_budget, depth=args.tree_depth, adaptive=args.adaptive, proposer=args.proposer)
    rows = [{"id": 0, "prompt": args.prompt}] if args.prompt is not None else read_prompts_file(args.prompts_file)
    for row in rows:  # the text, before loading the model: the chat template would hide an empty prompt
        refuse_empty_prompt(row["prompt"])
    engine, tokenizer = _load_generate_engine(args, tree)
    if args.proposer is None and getattr(engine, "meta", None) is not None:  # the engine's own default
        tree = dataclasses.replace(tree, proposer=engine.meta.tree_defaults.proposer)
    decoder = SpeculativeDecoder(engine, args.method, tree, tokenizer, max_batch_size=args.batch_size)
    requests = [GenerationRequest(encode_prompt(tokenizer, r["prompt"], not args.no_chat_template),
                                  max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  stop_strings=tuple(args.stop), seed=args.seed + i, request_id=r["id"])
                for i, r in enumerate(rows)]
    start = time.perf_counter()
    if args.prompt is not None:
        results = _stream_to_terminal(decoder, requests, tokenizer, args.stop)
    else:
        results = decoder.generate(requests)
    seconds = time.perf_counter() - start
    if args.prompt is None:
        _write_results(results, args.output)
    summary = summarize(results, seconds, args.method)
    for line in summary_lines(summary):
        print(line, file=sys.stderr)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def summarize(results, seconds: float, method: str) -> dict:
    from clover.stats import tokens_per_step

    new_tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.num_steps for r in results)
    accepted = sum(sum(r.stats.accepted_per_step) for r in results)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    return {
        "method": method,
        "num_prompts": len(results),
        "new_tokens": new_tokens,
        "decode_seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_step": tokens_per_step(new_tokens, steps, len(results)),
        "num_steps": steps,
        # the share of the drafted tree nodes that the target accepted (docs/trees.md#verification)
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "accepted_draft_tokens": accepted,
        "draft_tokens": drafted,
    }


def summary_lines(summary: dict) -> list[str]:
    """What ``clover generate`` says at the end: speed, tokens/step, acceptance rate, and how to compare."""
    line = (f"[clover] {summary['method']}: {summary['new_tokens']} tokens in {summary['decode_seconds']:.2f} s "
            f"({summary['tokens_per_second']:.1f} tok/s, {summary['tokens_per_step']:.2f} tokens/step")
    if summary["method"] == "vanilla":
        return [line + ")"]
    return [line + f", acceptance rate {summary['acceptance_rate']:.2f}: {summary['accepted_draft_tokens']} of "
                   f"{summary['draft_tokens']} draft tokens accepted)",
            "[clover] to compare: the same command with --method vanilla decodes without drafts (greedy: the same text)"]


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an engine with Triton Inference Server (HTTP, gRPC, metrics)",
        description="Run tritonserver on the Clover model repository (triton_repo/), pointed at an engine "
                    "directory: a tritonserver on PATH, else the binary of the nvidia-pytriton wheel. Concurrent "
                    "requests share decode steps (in-flight batching); streaming uses decoupled mode. "
                    "Ctrl-C or SIGTERM drains: new requests are refused, those in flight get --drain-timeout "
                    "seconds, then are cancelled. Closed by default: binds 127.0.0.1, and Triton's admin APIs "
                    "(shared memory, model repository, config, statistics, trace, logging) need the header "
                    "clover-admin-key: $CLOVER_ADMIN_KEY (unset: a random key, so they are closed). "
                    "Exit code: 0 after a clean shutdown; 1 when tritonserver did not exit cleanly or a model's "
                    "Python backend stub died (the server is then stopped), so a supervisor (systemd "
                    "Restart=on-failure, Kubernetes) restarts it. See docs/serving.md.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--engine", type=Path, help="engine directory from export/build_engine.py "
                   "(default: $CLOVER_ENGINE_DIR, else engines/demo in this checkout)")
    p.add_argument("--backend", choices=["auto", "onnxruntime", "tensorrt", "torch"], default="auto",
                   help="engine backend; auto takes the one engine.json names")
    p.add_argument("--method", choices=["auto", "clover", "clover2", "medusa", "vanilla", "suffix"], default="auto",
                   help="decoding method; auto: the engine's heads if it has some, else vanilla; suffix: candidates "
                        "copied from the prompt and answer only (also on an engine without heads)")
    p.add_argument("--proposer", choices=["auto", *PROPOSERS], default="auto",
                   help="model-free candidates merged into the heads' tree; auto: the engine's tree defaults "
                        "(suffix unless its engine.json says otherwise); none: the heads alone")
    p.add_argument("--max-batch", type=int, default=0, help="sequences decoded together at most (0: the engine's limit)")
    p.add_argument("--tree-budget", type=int, default=None, help="draft tree nodes per step (default: the engine's)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each step's tree budget (0 to --tree-budget) from the number of live sequences "
                        "with the engine's cost model; default: whenever the engine has one (export/build_engine.py "
                        "calibrates by default); --no-adaptive keeps --tree-budget fixed")
    p.add_argument("--threads", type=int, default=0, help="engine CPU threads (0: the backend's default)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the endpoints bind to (0.0.0.0: every interface, reachable from other machines)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="at shutdown, seconds in-flight requests may still run before they are cancelled "
                        "(tritonserver's --exit-timeout-secs is 5 s more)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (0: a free one)")
    p.add_argument("--model-repository", type=Path, help="serve this model repository as it is (ignores --engine)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the server to be ready")
    p.add_argument("--log-file", type=Path, help="where tritonserver's log (and the OpenAI frontend's) go; "
                   "default: a new clover-serve-<time>-<pid>.log in the temp directory, named at startup; "
                   "'-': the terminal")
    p.add_argument("--demo", action="store_true", help="the end-to-end demo instead: build the demo engine if missing, "
                   "start the server, stream answers to a few prompts, compare with vanilla, stop")
    p.add_argument("--max-tokens", type=_positive, default=96, help="with --demo: new tokens per answer")
    p.add_argument("--openai-port", type=int, default=None,
                   help="also serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
                        "on this port (0: a free one), in a process of its own; with --demo: serve the demo engine "
                        "(built if missing) until Ctrl-C instead of the scripted comparison")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from clover.serving.launch import run_demo, serve

    if args.demo and args.openai_port is None:
        return run_demo(args.engine, max_tokens=args.max_tokens, startup_timeout_s=args.startup_timeout)
    if args.demo:
        from clover.serving.launch import ensure_demo_engine

        args.engine = ensure_demo_engine(args.engine)
    return serve(args.engine, backend=args.backend, method=args.method, max_batch=args.max_batch,
                 tree_budget=args.tree_budget, adaptive=args.adaptive, proposer=args.proposer, threads=args.threads, host=args.host, http_port=args.http_port,
                 grpc_port=args.grpc_port, metrics_port=args.metrics_port, model_repository=args.model_repository,
                 startup_timeout_s=args.startup_timeout, log_file=args.log_file, openai_port=args.openai_port,
                 drain_s=args.drain_timeout)


def add_client_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "client",
        help="send prompts to a running clover serve (tritonclient), or generate load",
        description="Stream answers from the Clover model over gRPC (tritonclient) or HTTP (generate_stream). "
                    "With --concurrency N it is a load generator: N concurrent streams, reporting throughput, "
                    "time to first token and inter-token latency percentiles.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--url", help="server address (default: localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="transport")
    p.add_argument("--model", default="clover", help="model name in the repository")
    p.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSONL file of {"id": ..., "prompt": ...} lines')
    p.add_argument("--max-tokens", type=_positive, default=128, help="new tokens per answer at most")
    p.add_argument("--no-stream", action="store_true", help="one response per request instead of streaming")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (the server's default)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt text as is")
    p.add_argument("--concurrency", type=_positive, default=None, help="load generator: concurrent streams")
    p.add_argument("--requests", type=_positive, default=None, help="load generator: requests in all "
                   "(default: 4 x concurrency)")
    p.add_argument("--json", type=Path, help="load generator: write the report as JSON here")
    p.set_defaults(func=cmd_client)


def cmd_client(args) -> int:
    from clover.client import ClientError, GrpcClient, HttpClient, format_load_report, run_load
    from clover.prompts import read_prompts_file

    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += [row["prompt"] for row in read_prompts_file(args.prompts_file)]
    if not prompts:
        prompts = ["Explain speculative decoding in two sentences."]
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                   stop_words=args.stop or None, chat_template=False if args.no_chat_template else None)

    def make_client():
        return GrpcClient(url, args.model) if args.protocol == "grpc" else HttpClient(url, args.model)

    try:
        if args.concurrency:
            report = run_load(make_client, prompts, args.concurrency, args.requests or 4 * args.concurrency,
                              args.max_tokens, **options)
            print(format_load_report(report))
            if args.json:
                args.json.write_text(json.dumps(report, indent=2) + "\n")
            return 1 if report["errors"] else 0
        client = make_client()
        try:
            for prompt in prompts:
                start = time.perf_counter()
                if args.no_stream:
                    result = client.generate(prompt, args.max_tokens, **options)
                    sys.stdout.write(result.text)
                else:
                    from clover.client import collect

                    def shown(chunks):
                        for chunk in chunks:
                            sys.stdout.write(chunk.text)
                            sys.stdout.flush()
                            yield chunk

                    result = collect(shown(client.stream(prompt, args.max_tokens, **options)), start)
                sys.stdout.write("\n")
                perf = result.perf or {}
                ttft = f"{result.first_token_seconds * 1000:.0f} ms" if result.first_token_seconds is not None else "-"
                print(f"[clover] {len(result.token_ids)} tokens in {result.seconds:.2f} s "
                      f"({result.tokens_per_second:.1f} tok/s, first token {ttft}, "
                      f"acceptance rate {perf.get('acceptance_rate', 0.0):.2f}, "
                      f"{result.tokens_per_step:.2f} tokens/step, "
                      f"finish: {result.finish_reason})", file=sys.stderr)
        finally:
            close = getattr(client, "close", None)
            if close is not None:
                close()
        return 0
    except ClientError as exc:
        print(f"clover: error: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"clover: error: {exc}; install the clients with: pip install 'tritonclient[all]'", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"clover: error: cannot reach the server at {url}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clover", description="Clover: lossless regressive speculative decoding")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_client_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"clover: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nclover: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
