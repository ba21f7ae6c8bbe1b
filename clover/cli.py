"""``clover`` command line: ``clover generate|serve|client|build ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from clover.config import (CHECKPOINT_DTYPES, PROPOSERS, ConfigError, SamplingConfig, TreeConfig,
                           sampling_range_error)
from clover.methods import DEFAULT_METHOD, METHOD_CHOICES, METHODS, method_traits
from clover.rendezvous import add_rendezvous_options, rendezvous_of, start_followers, stop_followers
from clover.speed_report import report_lines


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


# the same words for clover generate and clover serve: both take the engine's tree defaults
TREE_BUDGET_HELP = (f"draft tree nodes per step, not counting the root; with the adaptive budget, the most a step "
                    f"may draft (default: the engine's tree defaults, {TreeConfig().budget} unless its engine.json "
                    f"says otherwise; {TreeConfig().budget} on the torch path)")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _sampling(name: str, kind: type = float):
    """An option type that refuses what every interface refuses (clover.config.SAMPLING_RANGES): clover client
    would otherwise send a request the server refuses, and clover generate would differ from the server."""
    def parse(text: str):
        value = kind(text)
        problem = sampling_range_error(name, value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem} (got {text})")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid float value" for text that is no number
    return parse


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
    p.add_argument("--engine", type=Path, help="built engine directory (clover build); replaces "
                   "--target/--drafter: tokenizer, heads and limits come from its engine.json")
    p.add_argument("--method", choices=METHODS, default=None,
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
    p.add_argument("--tree-budget", type=int, default=None, help=TREE_BUDGET_HELP)
    p.add_argument("--tree-depth", type=int, default=None, help="draft depth (default: every head)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose the tree budget each step (0 to --tree-budget) from the engine's cost model; "
                        "default: whenever the engine has one; --no-adaptive keeps --tree-budget fixed")
    p.add_argument("--backend", choices=["auto", "onnxruntime", "torch"], default="auto",
                   help="auto: the --engine if given; on a GPU the torch path (see --device); on the demo target "
                        "with its shipped Clover heads, the demo onnxruntime engine (built once into engines/demo of $CLOVER_HOME: the checkout, or "
                        "~/.cache/clover for an installed package; minutes); on the demo target with other heads "
                        "(--drafter DIR or demo-medusa), an engine for them, built once into engines/ of the cache "
                        "(--cache-dir), named by the heads' hash; else torch, said in one line. torch: the reference "
                        "path on --target/--drafter")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the torch path runs: auto (a CUDA GPU when torch sees one, else the CPU), cpu (the "
                        "fp32 reference engine) or cuda (the device engine in bf16, its steps replayed from CUDA "
                        "graphs: docs/gpu-engine.md); built engines run where they were built for")
    p.add_argument("--dtype", choices=CHECKPOINT_DTYPES, default="auto",
                   help="the torch path's weights: auto (bf16 on a GPU, fp32 on the CPU), fp32 (token-exact with "
                        "the fp32 reference) or bf16 (docs/gpu-engine.md#precision)")
    p.add_argument("--temperature", type=_sampling("temperature"), default=0.0,
                   help="0 is greedy; up to 2 samples (tree speculative sampling)")
    p.add_argument("--top-k", type=_sampling("top_k", int), default=0,
                   help="sample only from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=_sampling("top_p"), default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=_sampling("seed", int), default=0, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences decoded together at most")
    p.add_argument("--max-seq-len", type=_positive, default=2048, help="KV cache length per sequence")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as is")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch / onnxruntime "
                   "(default: each library's own choice, about one per physical core)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="decode the prompts again with vanilla decoding and report the speed-up and, where "
                        "speculation did not pay, why (as clover serve --demo does); default: on with --prompt, "
                        "off with --prompts-file")
    add_rendezvous_options(p)
    p.set_defaults(func=cmd_generate)


def _on_gpu(args) -> bool:
    """Whether the torch path would run on a GPU (``--device``), where the device engine beats a CPU engine."""
    if args.device == "cpu":
        return False
    import torch

    return args.device == "cuda" or torch.cuda.is_available()


def _generate_engine_dir(args) -> Path | None:
    """The engine directory ``clover generate`` decodes on, or None for the torch path (see ``--backend``)."""
    if args.engine is not None:
        if args.backend == "torch":
            raise ConfigError("--engine runs on its own backend; drop --backend torch (or --engine)")
        return args.engine
    if args.backend == "torch":
        return None
    heads = _demo_heads(args)
    if args.backend == "auto" and (heads is None or _on_gpu(args)):
        if heads is None and not _on_gpu(args):
            _say_torch_path(args)
        return None
    if heads is None:
        raise ConfigError("--backend onnxruntime needs --engine DIR, except on the demo target with its heads or "
                          "a directory of trained heads")
    from clover.export.builder import ensure_demo_engine, ensure_heads_engine

    def progress(message: str) -> None:
        print(f"[clover] {message}", file=sys.stderr, flush=True)

    if heads == "shipped":
        return ensure_demo_engine(progress=progress)
    return ensure_heads_engine(heads, args.cache_dir, progress=progress)


def _demo_heads(args) -> str | None:
    """What an onnxruntime engine can be built for here: ``shipped`` (the demo engine, the shipped Clover heads),
    a trained heads directory on the demo target (built once, cached), or None (the torch path)."""
    if args.target != "demo":
        return None
    if args.drafter in (None, "demo-clover"):
        fits = args.method is None or method_traits(args.method).runs_on_heads_of(DEFAULT_METHOD)
        return "shipped" if fits else None
    if args.drafter in ("untrained", "none"):
        return None
    from clover.demo import resolve_drafter

    heads_dir = resolve_drafter(args.drafter, "demo")  # demo-medusa: the shipped Medusa heads
    config = Path(heads_dir) / "config.json"
    if not config.is_file():
        return None  # the torch path says what is missing
    heads_method = json.loads(config.read_text()).get("method")
    fits = args.method is None or method_traits(args.method).runs_on_heads_of(heads_method)
    return heads_dir if fits else None


def _say_torch_path(args) -> None:
    """One line: ``clover generate`` runs the slow fp32 reference, and how to get the fast engine."""
    drafter = f" --drafter {args.drafter}" if args.drafter not in (None, "untrained") else ""
    print(f"[clover] decoding on the torch fp32 reference (slow on a CPU); for the fast engine: clover build "
          f"--target {args.target}{drafter} --output ENGINE, then --engine ENGINE", file=sys.stderr, flush=True)


def _load_generate_engine(args):
    """(engine, tokenizer) for ``clover generate``; fills in ``args.method`` from the engine's heads."""
    from clover.target import load_tokenizer

    if args.tensor_parallel > 1:
        return _load_rank_engine(args)
    engine_dir = _generate_engine_dir(args)
    if engine_dir is not None:
        from clover.backends import load_engine

        engine = load_engine(engine_dir, threads=args.threads)
        args.method = args.method or engine.spec.default_method
        return engine, load_tokenizer(engine_dir)
    from clover.backends import load_checkpoint_engine

    args.method = args.method or DEFAULT_METHOD
    engine = load_checkpoint_engine(args.target, args.drafter, args.method, args.max_seq_len, args.cache_dir,
                                    device=args.device, dtype=args.dtype)
    on_device = getattr(engine, "device_stepper", None) is not None  # it times its own steps (docs/gpu-engine.md)
    calibrate = _calibration_tokens(args)
    if calibrate and not on_device:
        engine.calibrate_cost_model(calibrate)
    return engine, load_tokenizer(engine.checkpoint_dir)


def _calibration_tokens(args) -> int | None:
    """Tokens per step to time the torch engine at for the adaptive budget; None: no timing."""
    if args.adaptive is False or not method_traits(args.method).drafts:
        return None
    print("[clover] timing the torch engine's steps for the adaptive tree budget (seconds)", file=sys.stderr)
    budget = TreeConfig().budget if args.tree_budget is None else args.tree_budget
    return min(256, args.batch_size * (1 + budget))


def _load_rank_engine(args):
    """Rank 0's (engine, tokenizer) of a tensor-parallel target; the other ranks load theirs from the same
    recipe (clover.lockstep)."""
    from clover.lockstep import EngineRecipe, load_engine

    if args.engine is not None or args.backend == "onnxruntime" or args.device == "cuda":
        raise ConfigError("--tensor-parallel runs the torch backend on the CPU: drop --engine, --backend "
                          "onnxruntime and --device cuda")
    args.method = args.method or DEFAULT_METHOD
    recipe = EngineRecipe(args.target, args.drafter, args.method, args.max_seq_len, args.cache_dir,
                          "bf16" if args.dtype == "bf16" else "fp32", args.threads, _calibration_tokens(args))
    return load_engine(recipe, args.shard)


def _new_decoder(args, engine, method: str, tree, tokenizer):
    """The decoder ``clover generate`` runs: every rank's in lock step under --tensor-parallel."""
    from clover.decode import SpeculativeDecoder

    if args.tensor_parallel > 1:
        from clover.lockstep import LockstepDecoder

        return LockstepDecoder(engine, method, tree, tokenizer, max_batch_size=args.batch_size)
    return SpeculativeDecoder(engine, method, tree, tokenizer, max_batch_size=args.batch_size)


def _with_ranks(args, body) -> int:
    """``body(args)`` as rank 0 of --tensor-parallel ranks: this host's others started, joined, stopped after."""
    from clover.lockstep import join, leave

    rendezvous = rendezvous_of(args)
    if rendezvous.node_rank != 0:
        raise ConfigError("--node-rank > 0: start that host's ranks with python -m clover.lockstep")
    if args.compare:
        raise ConfigError("--compare decodes twice; under --tensor-parallel run --method vanilla on its own")
    args.compare = False
    followers = start_followers(rendezvous)
    try:
        args.shard = join(rendezvous, 0)
        return body(args)
    finally:
        leave()
        stop_followers(followers)


def _stream_to_terminal(decoder, requests, tokenizer, stop: list[str]):
    """Decode one prompt, printing the answer as it grows (cut at a stop string); returns the results."""
    from clover.text import TextStream

    # holds back a partial character (U+FFFD until its last byte comes) and a possible start of a stop string
    text = TextStream(tokenizer, stop)

    def on_event(event):
        sys.stdout.write(text.push(event.new_token_ids, finished=False))
        sys.stdout.flush()

    results = decoder.generate(requests, on_event=on_event)
    sys.stdout.write(text.push([], finished=True) + "\n")
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
    if args.tensor_parallel > 1:
        return _with_ranks(args, _generate)
    return _generate(args)


def _generate(args) -> int:
    import torch

    from clover.decode import GenerationRequest
    from clover.prompts import encode_prompt, read_prompts_file, refuse_empty_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    rows = [{"id": 0, "prompt": args.prompt}] if args.prompt is not None else read_prompts_file(args.prompts_file)
    for row in rows:  # the text, before loading the model: the chat template would hide an empty prompt
        refuse_empty_prompt(row["prompt"])
    engine, tokenizer = _load_generate_engine(args)
    tree = _generate_tree(args, engine)
    decoder = _new_decoder(args, engine, args.method, tree, tokenizer)
    requests = [GenerationRequest(encode_prompt(tokenizer, r["prompt"], not args.no_chat_template),
                                  max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  stop_strings=tuple(args.stop), seed=args.seed + i, request_id=r["id"])
                for i, r in enumerate(rows)]
    compare = (args.prompt is not None if args.compare is None else args.compare) and method_traits(args.method).drafts
    if compare:  # both methods timed warm: the first calls of an engine are slower (clover serve --demo warms up too)
        _warm_up(decoder, requests[0])
    start = time.perf_counter()
    if args.prompt is not None:
        results = _stream_to_terminal(decoder, requests, tokenizer, args.stop)
    else:
        results = decoder.generate(requests)
    seconds = time.perf_counter() - start
    if args.prompt is None:
        _write_results(results, args.output)
    summary = summarize(results, seconds, args.method)
    if args.tensor_parallel > 1:  # every rank stepped each pass in lock step: a missing one would have failed it
        summary["tensor_parallel_ranks"] = args.shard.world_size
    for line in summary_lines(summary, compared=compare):
        print(line, file=sys.stderr)
    if compare:
        speed = _against_vanilla(_new_decoder(args, engine, "vanilla", tree, tokenizer),
                                 requests, results, seconds, greedy=sampling.temperature == 0)
        for line in report_lines([speed], args.method):
            print(f"[clover] {line}", file=sys.stderr)
        summary.update(vanilla_decode_seconds=speed.vanilla_seconds, speedup_vs_vanilla=speed.speedup)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _generate_tree(args, engine) -> TreeConfig:
    """The tree settings: the options given, else the engine's tree defaults (engine.json), as clover serve."""
    meta = getattr(engine, "meta", None)
    given = {"budget": args.tree_budget, "depth": args.tree_depth, "proposer": args.proposer}
    return dataclasses.replace(meta.tree_defaults if meta is not None else TreeConfig(), adaptive=args.adaptive,
                               **{name: value for name, value in given.items() if value is not None})


def _warm_up(decoder, request) -> None:
    """A few tokens of ``request``, untimed."""
    decoder.generate([dataclasses.replace(request, max_new_tokens=4)])


def _against_vanilla(vanilla, requests, results, seconds: float, greedy: bool):
    """The same requests decoded again by ``vanilla``: a PromptSpeed of all of them together."""
    from clover.speed_report import PromptSpeed

    print("[clover] decoding again without drafts (vanilla) to measure the speed-up; --no-compare skips it",
          file=sys.stderr, flush=True)
    _warm_up(vanilla, requests[0])
    start = time.perf_counter()
    plain = vanilla.generate(requests)
    vanilla_seconds = time.perf_counter() - start
    mine = summarize(results, seconds, "")
    same = [r.token_ids for r in results] == [r.token_ids for r in plain] if greedy else None
    return PromptSpeed(mine["new_tokens"], seconds, mine["tokens_per_step"], mine["acceptance_rate"],
                       sum(len(r.token_ids) for r in plain), vanilla_seconds, same)


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


def summary_lines(summary: dict, compared: bool = False) -> list[str]:
    """What ``clover generate`` says at the end: speed, tokens/step, acceptance rate, and (when it does not
    compare with vanilla itself) how to."""
    line = (f"[clover] {summary['method']}: {summary['new_tokens']} tokens in {summary['decode_seconds']:.2f} s "
            f"({summary['tokens_per_second']:.1f} tok/s, {summary['tokens_per_step']:.2f} tokens/step")
    ranks = summary.get("tensor_parallel_ranks")
    ranks_line = [f"[clover] tensor parallel: {ranks} ranks ran the target, each pass in lock step"] if ranks else []
    if not method_traits(summary["method"]).drafts:
        return [line + ")", *ranks_line]
    lines = [line + f", acceptance rate {summary['acceptance_rate']:.2f}: {summary['accepted_draft_tokens']} of "
                    f"{summary['draft_tokens']} draft tokens accepted)", *ranks_line]
    if not compared:
        lines.append("[clover] to compare: add --compare (decodes again with --method vanilla: greedy, the same "
                     "text) for the speed-up, or run python -m clover.bench for real numbers")
    return lines


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve an engine with Triton Inference Server (HTTP, gRPC, metrics)",
        description="Run tritonserver on a Clover model repository (written from the package's template), "
                    "pointed at an engine directory: a tritonserver on PATH, else the binary of the nvidia-pytriton "
                    "wheel. Concurrent requests share decode steps (in-flight batching); streaming uses decoupled "
                    "mode. "
                    "Ctrl-C or SIGTERM drains: new requests are refused, those in flight get --drain-timeout "
                    "seconds, then are cancelled; a second Ctrl-C cancels them at once (exit code 1). "
                    "Closed by default: binds 127.0.0.1, and Triton's admin APIs "
                    "(shared memory, model repository, config, statistics, trace, logging) need the header "
                    "clover-admin-key: $CLOVER_ADMIN_KEY (unset: a random key, so they are closed). "
                    "Exit code: 0 after a clean shutdown; 1 when tritonserver did not exit cleanly or a model's "
                    "Python backend stub died (the server is then stopped), so a supervisor (systemd "
                    "Restart=on-failure, Kubernetes) restarts it. See docs/serving.md.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--engine", type=Path, help="engine directory from clover build "
                   "(default: $CLOVER_ENGINE_DIR, else on a machine with a CUDA GPU the demo checkpoint on the "
                   "device engine (--backend torch), else engines/demo in $CLOVER_HOME: the checkout, or "
                   "~/.cache/clover for an installed package)")
    p.add_argument("--backend", choices=["auto", "onnxruntime", "tensorrt", "torch"], default="auto",
                   help="engine backend; auto takes the one engine.json names")
    p.add_argument("--method", choices=METHOD_CHOICES, default="auto",
                   help="decoding method; auto: the engine's heads if it has some, else vanilla; suffix: candidates "
                        "copied from the prompt and answer only (also on an engine without heads)")
    p.add_argument("--proposer", choices=["auto", *PROPOSERS], default="auto",
                   help="model-free candidates merged into the heads' tree; auto: the engine's tree defaults "
                        "(suffix unless its engine.json says otherwise); none: the heads alone")
    p.add_argument("--max-batch", type=int, default=0, help="sequences decoded together at most (0: the engine's limit)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="prompt tokens one step prefills, plus one per decoding sequence, at most (vLLM's "
                        "max_num_batched_tokens): a burst streams its first tokens a few prompts at a time; "
                        "0: no cap; default: the model parameter's (docs/serving.md#first-tokens-under-a-burst)")
    p.add_argument("--tree-budget", type=int, default=None, help=TREE_BUDGET_HELP)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each step's tree budget (0 to --tree-budget) from the number of live sequences "
                        "with the engine's cost model; default: whenever the engine has one (clover build "
                        "calibrates by default); --no-adaptive keeps --tree-budget fixed")
    p.add_argument("--threads", type=int, default=0, help="engine CPU threads (0: the backend's default)")
    p.add_argument("--dtype", choices=CHECKPOINT_DTYPES, default="auto",
                   help="with --backend torch, the weights' precision: auto (bf16 on a GPU, fp32 on a CPU), fp32 "
                        "(token-exact with the fp32 reference) or bf16; a built engine has its own")
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
                   "default: a new clover-serve-<time>-<pid>.log in the temp directory, named at startup, "
                   "removed after a clean exit and kept after a failure; "
                   "'-': the terminal")
    p.add_argument("--demo", action="store_true", help="the end-to-end demo instead: build the demo engine if missing, "
                   "start the server, stream answers to two prompts (one copied, one new prose), report each one's "
                        "tokens/step and speed-up against vanilla as clover generate does, stop")
    p.add_argument("--max-tokens", type=_positive, default=96, help="with --demo: new tokens per answer")
    p.add_argument("--openai-port", type=int, default=None,
                   help="also serve an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
                        "on this port (0: a free one), in a process of its own; with --demo: serve the demo engine "
                        "(built if missing) until Ctrl-C instead of the scripted comparison")
    add_rendezvous_options(p)
    p.set_defaults(func=cmd_serve)


def _serve_on_gpu_by_default(args, cuda: bool | None = None) -> None:
    """``clover serve`` with neither an engine (nor ``$CLOVER_ENGINE_DIR``) nor a backend named, where torch sees a
    CUDA GPU: the demo checkpoint on the device engine (docs/gpu-engine.md#serving), not the demo's CPU engine.
    ``cuda``: whether a GPU is here (None: ask torch)."""
    import os

    from clover.demo import ENGINE_ENV

    named = args.engine is not None or os.environ.get(ENGINE_ENV) or args.model_repository is not None
    if named or args.backend != "auto" or args.demo:
        return
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        print("[clover] a CUDA GPU is here: serving the demo checkpoint on the device engine (--backend torch); "
              "pass --engine DIR to serve a built engine", file=sys.stderr)
        args.engine, args.backend = Path("demo"), "torch"


def cmd_serve(args) -> int:
    from clover.serving.launch import run_demo, serve

    if args.demo and args.openai_port is None:
        return run_demo(args.engine, max_tokens=args.max_tokens, startup_timeout_s=args.startup_timeout)
    if args.demo:
        from clover.serving.launch import ensure_demo_engine

        args.engine = ensure_demo_engine(args.engine)
    _serve_on_gpu_by_default(args)
    if args.dtype != "auto" and args.backend != "torch":
        raise ConfigError("--dtype sets the torch backend's weights; add --backend torch (a built engine has its own "
                          "precision)")
    return serve(args.engine, backend=args.backend, method=args.method, max_batch=args.max_batch,
                 max_step_tokens=args.max_step_tokens, tree_budget=args.tree_budget, adaptive=args.adaptive, proposer=args.proposer, threads=args.threads,
                 dtype=args.dtype, host=args.host, http_port=args.http_port,
                 grpc_port=args.grpc_port, metrics_port=args.metrics_port, model_repository=args.model_repository,
                 startup_timeout_s=args.startup_timeout, log_file=args.log_file, openai_port=args.openai_port,
                 drain_s=args.drain_timeout, rendezvous=_serve_rendezvous(args))


def _serve_rendezvous(args):
    """Where ``clover serve --tensor-parallel N``'s ranks meet; None for one rank."""
    if args.tensor_parallel == 1:
        return None
    rendezvous = rendezvous_of(args)
    if rendezvous.node_rank != 0:
        raise ConfigError("--node-rank > 0: start that host's ranks with python -m clover.lockstep")
    return rendezvous


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
    p.add_argument("--temperature", type=_sampling("temperature"), default=None,
                   help="0 is greedy (the server's default); up to 2 samples")
    p.add_argument("--top-k", type=_sampling("top_k", int), default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=_sampling("top_p"), default=None, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=_sampling("seed", int), default=None, help="random seed for sampling")
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
    except (ClientError, ConnectionError) as exc:
        # one line: where nothing listens, the transport's own error (gRPC's "failed to connect to all
        # addresses; ...") says less than this
        if _listening(url):
            print(f"clover: error: {exc}", file=sys.stderr)
        else:
            print(f"clover: error: nothing listens at {url}; start the server first, in another terminal: clover "
                  "serve (or pass --url where it runs)", file=sys.stderr)
        return 1
    except ImportError as exc:
        print(f"clover: error: {exc}; install the clients with: pip install 'tritonclient[all]'", file=sys.stderr)
        return 2


def _listening(url: str) -> bool:
    """Whether a TCP connection to ``host:port`` opens: tells "no server there" from a server's refusal."""
    import socket

    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def add_build_parser(subparsers) -> None:
    # the options are clover.export.command's own, parsed there (also python -m clover.export): clover build
    # passes its arguments on
    p = subparsers.add_parser("build", add_help=False,
                              help="build an engine directory (clover build --help lists its options)")
    p.set_defaults(func=cmd_build)


def cmd_build(args) -> int:
    """``clover build ARGS``: :func:`clover.export.command.main` (one parser, in the package)."""
    from clover.export.command import main as build_main

    return build_main(args.build_args, prog="clover build")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from clover import __version__

    try:
        return version("clover-decoding")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Clover: lossless regressive speculative decoding")
    parser.add_argument("--version", action="version", version=f"clover {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_client_parser(subparsers)
    add_build_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "build":
        args.build_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
