"""Write a Triton model repository whose Clover model points at a given engine.

The template is package data: the model's thin ``model.py`` (``clover/serving/triton_template/``)
and its ``config.pbtxt``, rendered by :func:`clover.serving.protocol.render_model_config`; so an installed
wheel serves without a checkout. ``clover serve`` writes a filled copy to a temporary directory, and
``python -m clover.serving.repository OUT --engine DIR`` writes one to keep (a checkout's committed
``triton_repo/`` is the same template with the defaults)::

    python -m clover.serving.repository my_repo --engine engines/mine
    tritonserver --model-repository my_repo ...
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Mapping

from clover.config import ConfigError
from clover.serving.protocol import render_model_config

MODEL_NAME = "clover"
# the Python-backend entry point every written model runs (package data: it imports triton_python_backend_utils,
# which only Triton's stub has, so nothing imports it)
TEMPLATE_MODEL_PY = Path(__file__).resolve().parent / "triton_template" / "model.py"


def model_py(source: Path | None = None) -> Path:
    """The ``model.py`` to copy: ``source``'s (a model repository) if given, else the package's template."""
    path = source / MODEL_NAME / "1" / "model.py" if source is not None else TEMPLATE_MODEL_PY
    if not path.exists():
        raise ConfigError(f"{path} is missing" + ("" if source is not None else
                          ": this clover install is incomplete; reinstall it (pip install --force-reinstall)"))
    return path


def write_repository(dest: str | Path, models: Mapping[str, Mapping[str, str]] | None = None,
                     source: Path | None = None, overwrite: bool = False) -> Path:
    """Write a model repository with one Clover model per entry of ``models``.

    ``models`` maps a model name to its config parameters (see
    :data:`clover.serving.protocol.PARAMETERS`); default: one model ``clover`` with the defaults.
    Engine directories are written as absolute paths.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        if not overwrite:
            raise ConfigError(f"{dest} exists and is not empty")
        shutil.rmtree(dest)
    code = model_py(source)
    for name, params in (models or {MODEL_NAME: {}}).items():
        params = dict(params)
        if params.get("engine_dir") and params["engine_dir"] != "demo":
            params["engine_dir"] = str(Path(params["engine_dir"]).expanduser().resolve())
        version = dest / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(code, version / "model.py")
        (dest / name / "config.pbtxt").write_text(render_model_config(params))
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Write a Triton model repository whose clover model serves ENGINE.")
    p.add_argument("output", type=Path, help="model repository directory to write")
    p.add_argument("--engine", required=True, help="engine directory (clover build)")
    p.add_argument("--backend", default="auto", help="auto, onnxruntime, tensorrt or torch")
    p.add_argument("--method", default="auto", help="auto, clover, clover2, medusa or vanilla")
    p.add_argument("--max-batch", default="0", help="in-flight batch size at most (0: the engine's limit)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT")
    args = p.parse_args(argv)
    try:
        write_repository(args.output, {MODEL_NAME: {"engine_dir": args.engine, "backend": args.backend,
                                                    "method": args.method, "max_batch": args.max_batch}},
                         overwrite=args.overwrite)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}; serve it with: tritonserver --model-repository {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
