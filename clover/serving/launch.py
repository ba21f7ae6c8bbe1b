"""``clover serve``: run tritonserver on the Clover model repository, and the end-to-end demo.

:func:`serve` writes a temporary copy of ``triton_repo/`` whose model points
at the engine (the committed repository is left as it is), starts
tritonserver, waits for readiness with a deadline, prints the endpoints and
runs until Ctrl-C (or SIGTERM), which drains the model and stops tritonserver
(docs/serving.md#shutdown-faults-and-security). It exits non-zero when
tritonserver did not exit cleanly or a Python backend stub died, so that a
supervisor restarts it.

:func:`run_demo` is the whole path on one machine: build the demo engine if it
is missing, start the server, stream answers to a few prompts through
tritonclient, compare each answer's tokens/step and speed with vanilla decoding
on the same engine (a second model in the same server) as ``clover generate``
does (:mod:`clover.speed_report`), and stop the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from clover.config import ConfigError
from clover.demo import default_engine_dir, default_engine_source
from clover.rendezvous import Rendezvous, start_followers, stop_followers
from clover.serving.repository import MODEL_NAME, write_repository
from clover.serving.server import ADMIN_HEADER, ADMIN_KEY_ENV, ServerError, TritonServer, free_port

# how often clover serve checks that tritonserver and its stubs live; a dead stub is noticed within this
HEALTH_POLL_S = 0.5
# seconds the OpenAI frontend's drain outlasts the model's: the model ends each request with its final response
FRONTEND_DRAIN_MARGIN_S = 2.0

# one answer of each kind (docs/results/cpu-speed.md#reading-the-numbers): one that copies its prompt, which the
# drafts guess well, and one of new prose, which they rarely guess; the list is README.md's (a test holds them equal)
DEMO_PROMPTS = (
    "Copy this list, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew.",
    "Tell me a story about a dragon.",
)


def resolve_serve_engine(engine: str | Path | None, backend: str = "auto") -> Path:
    """The engine directory to serve; ConfigError with the build command if there is none."""
    engine_dir = Path(engine) if engine is not None else default_engine_dir()
    if backend != "torch" and not (engine_dir / "engine.json").exists():
        chosen_by = f" ({default_engine_source()})" if engine is None else ""  # where a newcomer did not look
        raise ConfigError(f"no engine at {engine_dir}{chosen_by}; build it with: clover build --output {engine_dir}"
                          "   (or pass --engine DIR)")
    return engine_dir


class _SigtermAsInterrupt:
    """While serving, SIGINT (Ctrl-C) and SIGTERM both raise KeyboardInterrupt, so both stop the server
    cleanly (SIGINT too where it was inherited as ignored, as in background jobs of a script)."""

    def __enter__(self):
        def handler(signum, frame):
            raise KeyboardInterrupt

        self.previous = {}
        try:
            self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
            self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)


def serve(engine: str | Path | None = None, *, backend: str = "auto", method: str = "auto", max_batch: int = 0,
          max_step_tokens: int | None = None, tree_budget: int | None = None, adaptive: bool | None = None,
          proposer: str = "auto", threads: int = 0, dtype: str = "auto", host: str = "127.0.0.1",
          http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
          model_repository: str | Path | None = None, startup_timeout_s: float = 600.0,
          log_file: str | Path | None = None, out: TextIO = sys.stdout, openai_port: int | None = None,
          drain_s: float = 10.0, rendezvous: Rendezvous | None = None) -> int:
    """Serve until Ctrl-C (or SIGTERM); returns the exit code: 0 after a clean shutdown, else 1. ``dtype``: the
    torch backend's weights (model parameter ``dtype``).
    ``openai_port``: also run the OpenAI-compatible frontend (its own process) there. ``drain_s``: at
    shutdown, seconds in-flight requests may still run before they are cancelled. ``log_file``: where
    tritonserver's and the frontend's output go; None: a new file in the temp directory (named on ``out``), removed
    after a clean exit and kept (its path said again) after a failure; "-": the terminal. ``rendezvous``: a
    tensor-parallel target (backend torch): this host's ranks other than 0 are started here, and a dead one
    stops the server (docs/serving.md#tensor-parallel)."""
    workdir = Path(tempfile.mkdtemp(prefix="clover-serve-"))
    server = frontend = None
    followers = []
    ours = log_file is None  # a log clover serve named itself is clover serve's to remove
    log_file = default_log_file() if ours else (None if str(log_file) == "-" else Path(log_file))
    try:
        # checked before tritonserver starts: the frontend reads the engine's tokenizer and context
        openai_engine = _openai_engine(engine, backend, model_repository) if openai_port is not None else None
        if model_repository is not None:
            repo = Path(model_repository)
            what = f"model repository {repo}"
        else:
            engine_dir = resolve_serve_engine(engine, backend)
            params = {"engine_dir": str(engine_dir), "backend": backend, "method": method,
                      "max_batch": str(max_batch), "threads": str(threads), "proposer": proposer, "dtype": dtype}
            if tree_budget is not None:
                params["tree_budget"] = str(tree_budget)
            if max_step_tokens is not None:  # None: the model's default (docs/serving.md#model-parameters)
                params["max_step_tokens"] = str(max_step_tokens)
            if adaptive is not None:  # None: the model's default (adaptive where the engine has a cost model)
                params["adaptive"] = "true" if adaptive else "false"
            params.update(_tensor_parallel_params(rendezvous, backend))
            repo = write_repository(workdir / "model_repository", {MODEL_NAME: params})
            what = f"engine {engine_dir}"
        with _SigtermAsInterrupt():
            try:
                server = TritonServer(repo, http_port, grpc_port, metrics_port, host=host, log_file=log_file,
                                      drain_s=drain_s)
                print(f"[clover] starting tritonserver ({server.install.source}: {server.install.binary}) on {what}",
                      file=out, flush=True)
                if log_file is not None:
                    print(f"[clover] server log: {log_file}", file=out, flush=True)
                if rendezvous is not None:
                    followers = start_followers(rendezvous, log_file)
                server.start()
                server.wait_ready(startup_timeout_s)
                _print_endpoints(server, out)
                if openai_engine is not None:
                    frontend = _openai_frontend(openai_engine, server, openai_port)
                    _start_openai(frontend, startup_timeout_s, out)
                return keep_log_on_failure(_wait_for_exit(server, frontend, out, followers), log_file if ours else None)
            except KeyboardInterrupt:
                return keep_log_on_failure(_drain_and_stop(server, frontend, drain_s, log_file, out),
                                           log_file if ours else None)
    except ServerError as exc:
        print(f"clover: error: {exc}", file=sys.stderr)
        return keep_log_on_failure(1, log_file if ours else None)
    finally:
        if frontend is not None:
            frontend.stop()  # first: its open streams end while tritonserver still answers
        if server is not None:
            server.stop()
        stop_followers(followers)  # after rank 0's stop told them to leave; no orphans either way
        shutil.rmtree(workdir, ignore_errors=True)


def _drain_and_stop(server: TritonServer | None, frontend, drain_s: float, log_file: Path | None,
                    out: TextIO) -> int:
    """The first Ctrl-C (or SIGTERM): the drain, then the stop; a second Ctrl-C meanwhile stops at once
    (exit code 1: requests were cut short, though each still ended with its final response)."""
    print(f"\n[clover] stopping {'the OpenAI frontend and ' if frontend else ''}tritonserver (requests in "
          f"flight get {drain_s:g} s; Ctrl-C again stops at once) ...", file=out, flush=True)
    if server is not None:
        # first: the model ends the requests in flight at the drain deadline, each with its final
        # response, which the frontend still forwards (its open streams end with data: [DONE])
        server.request_drain()
    if frontend is not None:
        print(f"[clover] stopped the OpenAI frontend (exit code {_shown(frontend.stop())})", file=out, flush=True)
    forced = frontend is not None and frontend.forced
    if forced and server is not None:
        server.kill()  # asked to stop at once: the frontend's streams have ended, tritonserver gets no drain
    code = server.stop() if server is not None else 0
    if forced or (server is not None and server.forced):
        print("[clover] stopped at once (second Ctrl-C): requests in flight were cut short", file=out, flush=True)
        print("clover: error: stopped before the drain ended (exit code 1)", file=sys.stderr, flush=True)
        return 1
    return _report_stop(code, log_file, out)


def _report_stop(code: int | None, log_file: Path | None, out: TextIO) -> int:
    """Say how tritonserver stopped; clover serve's exit code: 0 only for a known clean exit, so a supervisor
    restarts it after anything else (an exit code that could not be learnt included)."""
    shown = _shown(code)
    print(f"[clover] stopped (exit code {shown})", file=out, flush=True)
    if code == 0:
        return 0
    where = f": {log_file}" if log_file is not None else ""
    print(f"clover: error: tritonserver did not exit cleanly (exit code {shown}); see its log{where}",
          file=sys.stderr, flush=True)
    return 1


def _shown(code: int | None) -> str:
    return "unknown" if code is None else str(code)


def keep_log_on_failure(code: int, default_log: Path | None) -> int:
    """``code``, after tidying ``default_log`` (the log clover serve named itself; None: one the user chose, or
    none): removed after a clean exit, so every run does not leave a file in the temp directory; kept after a
    failure, where it is the one record of what went wrong, and its path said again on stderr."""
    if default_log is None or not default_log.exists():
        return code
    if code == 0:
        default_log.unlink(missing_ok=True)
    else:
        print(f"[clover] the server log is kept: {default_log}", file=sys.stderr, flush=True)
    return code


def default_log_file() -> Path:
    """Where ``clover serve`` writes the server log unless told otherwise: a new file in the temp directory."""
    return Path(tempfile.gettempdir()) / f"clover-serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def _print_endpoints(server: TritonServer, out: TextIO) -> None:
    """The banner: the addresses really bound (0.0.0.0 is every interface, not only this machine)."""
    bound = server.host if server.host not in ("0.0.0.0", "::") else f"{server.host} (every interface)"
    url = server.client_host
    print(f"[clover] ready (pid {server.pid}), bound to {bound}.\n"
          f"  HTTP    http://{url}:{server.http_port}  (POST /v2/models/{MODEL_NAME}/generate, "
          f"/v2/models/{MODEL_NAME}/generate_stream)\n"
          f"  gRPC    {url}:{server.grpc_port}\n"
          f"  metrics http://{url}:{server.metrics_port}/metrics\n"
          f"  admin APIs need the header {ADMIN_HEADER} (${ADMIN_KEY_ENV}; unset: closed)\n"
          f"  try: clover client --url {url}:{server.grpc_port} --prompt \"Hello!\"\n"
          "Ctrl-C stops the server.", file=out, flush=True)


def _openai_engine(engine, backend: str, model_repository) -> Path:
    """The built engine directory whose tokenizer and context the OpenAI frontend uses."""
    if backend == "torch" or (model_repository is not None and engine is None):
        raise ConfigError("--openai-port needs a built engine directory for its tokenizer and context: "
                          "pass --engine DIR (with --model-repository: the engine that repository serves)")
    return resolve_serve_engine(engine, backend)


def _openai_frontend(engine_dir: Path, server: TritonServer, port: int):
    from clover.serving.openai_frontend import FrontendProcess

    # the frontend's own drain ends a request only if the model's did not (the margin: its final response)
    return FrontendProcess(engine_dir, server.grpc_url, port or free_port(), host=server.host, model=MODEL_NAME,
                           log_file=server.log_file, drain_s=server.drain_s + FRONTEND_DRAIN_MARGIN_S)


def _start_openai(frontend, timeout_s: float, out: TextIO) -> None:
    """Start the OpenAI-compatible frontend and wait until it reaches the model."""
    frontend.start().wait_ready(timeout_s)
    print(f"[clover] OpenAI-compatible endpoint ready (pid {frontend.process.pid}): {frontend.url}/v1  "
          f"(model \"{MODEL_NAME}\": /v1/chat/completions, /v1/completions, /v1/models)", file=out, flush=True)


def _tensor_parallel_params(rendezvous: Rendezvous | None, backend: str) -> dict[str, str]:
    """The model parameters of a tensor-parallel target (none for one rank)."""
    if rendezvous is None or rendezvous.world_size == 1:
        return {}
    if backend != "torch":
        raise ConfigError("--tensor-parallel needs --backend torch (--engine: a checkpoint directory or 'demo')")
    return {"tensor_parallel": str(rendezvous.world_size),
            "rendezvous": f"{rendezvous.master_addr}:{rendezvous.master_port}"}


def _dead_follower(followers) -> str | None:
    dead = [proc for proc in followers if proc.poll() is not None]
    return None if not dead else ", ".join(f"pid {p.pid} exited with code {p.returncode}" for p in dead)


def _wait_for_exit(server: TritonServer, frontend, out: TextIO, followers=()) -> int:
    """Block until tritonserver exits, a Python backend stub dies (tritonserver is then killed: its readiness
    would stay true while requests hang), the OpenAI frontend exits, or a tensor-parallel rank does; the last
    three are failures (exit code 1, for a supervisor to restart clover serve: docs/serving.md#worker-health)."""
    while True:
        code = server.wait(HEALTH_POLL_S)
        if code is not None:
            print(f"[clover] tritonserver exited with code {code}", file=out, flush=True)
            return 0 if code == 0 else 1
        dead = server.dead_stubs()
        if dead:
            print(f"clover: error: the Python backend stub (pid {', '.join(map(str, dead))}) died; stopping "
                  "tritonserver (in-flight requests fail)", file=sys.stderr, flush=True)
            server.kill()  # nothing answers the requests in flight: a drain would only make them wait
            return 1
        dead_rank = _dead_follower(followers)
        if dead_rank:
            print(f"clover: error: a tensor-parallel rank died ({dead_rank}); stopping tritonserver",
                  file=sys.stderr, flush=True)
            server.kill()  # rank 0's next step would wait on it: readiness false now, not after a timeout
            return 1
        if frontend is not None and frontend.poll() is not None:
            print(f"clover: error: the OpenAI frontend (pid {frontend.process.pid}) exited with code "
                  f"{frontend.poll()}; stopping tritonserver", file=sys.stderr, flush=True)
            return 1


def ensure_demo_engine(engine: str | Path | None = None, out: TextIO = sys.stdout) -> Path:
    """The demo engine directory, built first if it is missing (or, the default one, stale):
    :func:`clover.export.builder.ensure_demo_engine` with the progress on ``out``."""
    from clover.export.builder import ensure_demo_engine as build_if_needed

    return build_if_needed(engine, progress=lambda message: print(f"[clover] {message}", file=out, flush=True))


def run_demo(engine: str | Path | None = None, prompts=DEMO_PROMPTS, max_tokens: int = 96,
             startup_timeout_s: float = 600.0, out: TextIO = sys.stdout) -> int:
    """Build (if needed) and serve the demo engine, stream answers, compare with vanilla, stop."""
    engine_dir = ensure_demo_engine(engine, out)
    workdir = Path(tempfile.mkdtemp(prefix="clover-demo-"))
    try:
        repo = write_repository(workdir / "model_repository",
                                {MODEL_NAME: {"engine_dir": str(engine_dir)},
                                 f"{MODEL_NAME}_vanilla": {"engine_dir": str(engine_dir), "method": "vanilla"}})
        with _SigtermAsInterrupt(), TritonServer(repo, 0, 0, 0, host="127.0.0.1",
                                                 log_file=workdir / "tritonserver.log") as server:
            print(f"[clover] starting tritonserver on {engine_dir} ...", file=out, flush=True)
            start = time.perf_counter()
            server.start().wait_ready(startup_timeout_s)
            print(f"[clover] ready in {time.perf_counter() - start:.0f} s: gRPC {server.grpc_url}, "
                  f"HTTP {server.http_url}, metrics {server.metrics_url}", file=out, flush=True)
            rows = _demo_answers(server, prompts, max_tokens, out)
            _print_speed_report(rows, engine_dir, out)
            print("[clover] stopping the server", file=out, flush=True)
        return 0 if all(row.same_text for row in rows) else 1
    except ServerError as exc:
        print(f"clover: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[clover] interrupted; the server was stopped", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _demo_answers(server: TritonServer, prompts, max_tokens: int, out: TextIO) -> list:
    """Each prompt streamed from the Clover model, then decoded whole by the vanilla one: a PromptSpeed each."""
    from clover.client import GrpcClient, collect
    from clover.speed_report import PromptSpeed, prompt_line, reason

    rows = []
    with GrpcClient(server.grpc_url, MODEL_NAME) as fast, GrpcClient(server.grpc_url, f"{MODEL_NAME}_vanilla") as plain:
        for client in (fast, plain):  # warm-up
            client.generate("Hi", 4)
        for prompt in prompts:
            print(f"\n>>> {prompt}", file=out, flush=True)
            begin = time.perf_counter()

            def shown(chunks):
                for chunk in chunks:
                    out.write(chunk.text)
                    out.flush()
                    yield chunk

            clover = collect(shown(fast.stream(prompt, max_tokens)), begin)
            vanilla = plain.generate(prompt, max_tokens)
            out.write("\n")
            speed = PromptSpeed(len(clover.token_ids), clover.seconds, clover.tokens_per_step,
                                (clover.perf or {}).get("acceptance_rate", 0.0), len(vanilla.token_ids),
                                vanilla.seconds, clover.text == vanilla.text)
            rows.append(speed)
            print(prompt_line(speed), file=out, flush=True)
            why = reason(speed)
            if why:
                print(f"  why: {why}", file=out, flush=True)
    return rows


def _print_speed_report(rows: list, engine_dir: Path, out: TextIO) -> None:
    """All prompts together, what this engine changes about them, and where real numbers come from."""
    from clover.engine_dir import read_engine_meta
    from clover.speed_report import BENCH_POINTER, combined, engine_note, prompt_line

    total = combined(rows)
    print(f"\n[clover] {len(rows)} prompts through Triton (gRPC streaming), on the same engine: "
          f"{prompt_line(total)}", file=out, flush=True)
    note = engine_note(read_engine_meta(engine_dir)) if total.speedup < 1.0 else None
    for line in ([note] if note else []) + [BENCH_POINTER]:
        print(f"[clover] {line}", file=out, flush=True)
