"""Results of scripts/gpu_check.py: the machine it ran on, report.json, summary.md and the printed table.

No torch at import: ``--help`` and the report need none (the environment probe imports it when called).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

FAILED = ("fail", "error", "timeout")  # any of these makes the exit status 1


def outcome(status: str, reason: str = "", seconds: float | None = None, data: dict | None = None,
            tables: list[dict] | None = None, notes: list[str] | None = None) -> dict:
    """One step's result: status pass / fail / skip / error / timeout, why, and what it measured."""
    return {"status": status, "reason": reason, "seconds": None if seconds is None else round(seconds, 1),
            "data": data or {}, "tables": tables or [], "notes": notes or []}


def table(title: str, columns: list[str], rows: list[list]) -> dict:
    return {"title": title, "columns": columns, "rows": rows}


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def any_failed(results: dict[str, dict]) -> bool:
    return any(r["status"] in FAILED for r in results.values())


# -- the machine ------------------------------------------------------------------------------------------


def _command_output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc() -> str | None:
    """nvcc's release line, found as torch's extension builder finds it (PATH, then CUDA_HOME)."""
    candidates = [shutil.which("nvcc")] + [str(Path(os.environ[v]) / "bin" / "nvcc")
                                           for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    candidates.append("/usr/local/cuda/bin/nvcc")
    for nvcc in filter(None, candidates):
        version = _command_output([nvcc, "--version"])
        if version:
            return version.splitlines()[-1]
    return None


def _gpus() -> list[str]:
    """One line per GPU from nvidia-smi: this process creates no CUDA context (the steps' processes do)."""
    query = "--query-gpu=name,compute_cap,memory.total,driver_version"
    listing = _command_output(["nvidia-smi", query, "--format=csv,noheader"])
    return listing.splitlines() if listing else []


def environment(args, argv: list[str]) -> dict:
    import torch  # here, not at import: --help needs no torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "dry run (CPU, tiny shapes)" if args.dry_run else "GPU",
        "command": " ".join(["bash scripts/gpu_check.sh", *argv]),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_devices": list(range(torch.cuda.device_count())), "gpus": _gpus(), "nvcc": _nvcc(),
        "transformers": _version("transformers"), "onnxruntime": _version("onnxruntime"),
        "numpy": _version("numpy"),
        "commit": _command_output(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "HEAD"]),
        "executable": sys.executable,
    }


def environment_line(env: dict) -> str:
    gpus = "; ".join(env["gpus"]) or f"{len(env['cuda_devices'])} CUDA device(s)" if env["cuda_devices"] else "none"
    return (f"{env['mode']}: torch {env['torch']} (CUDA {env['torch_cuda']}), GPUs: {gpus}, nvcc: {env['nvcc']}, "
            f"transformers {env['transformers']}, onnxruntime {env['onnxruntime']}")


# -- report.json, summary.md and the printed table --------------------------------------------------------


def status_line(result: dict) -> str:
    seconds = "" if result.get("seconds") is None else f" in {result['seconds']} s"
    reason = result["reason"].splitlines()[0] if result["reason"] else ""
    return f"   {result['status'].upper()}{seconds}" + (f": {reason}" if reason else "")


def text_table(results: dict[str, dict]) -> str:
    rows = [["step", "status", "seconds", "reason"]]
    for name, r in results.items():
        reason = r["reason"].splitlines()[0] if r["reason"] else ""
        rows.append([name, r["status"].upper(), "" if r.get("seconds") is None else str(r["seconds"]), reason[:100]])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    verdict = "FAIL" if any_failed(results) else "PASS"
    return "\n".join(["", *lines, "", f"overall: {verdict}"])


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "/").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _step_section(result: dict) -> list[str]:
    lines = ["", f"## {result['name']}: {result.get('title', '')}", "", f"**{result['status'].upper()}**"
             + (f": {result['reason']}" if result["reason"] else "")]
    lines += [""] + [f"- {note}" for note in result["notes"]] if result["notes"] else []
    for t in result["tables"]:
        lines += ["", f"{t['title']}:", ""] + markdown_table(t["columns"], t["rows"])
    return lines


def markdown(env: dict, results: dict[str, dict]) -> str:
    verdict = "FAIL" if any_failed(results) else ("PASS" if results else "NOT RUN")
    gpus = "; ".join(env["gpus"]) or "none"
    lines = [f"# Clover GPU check: {verdict}", "",
             f"- {env['date']}, {env['mode']}, `{env['command']}`",
             f"- GPUs: {gpus}; torch {env['torch']} (CUDA {env['torch_cuda']}), nvcc {env['nvcc']}, "
             f"transformers {env['transformers']}, onnxruntime {env['onnxruntime']}, Python {env['python']}, "
             f"{env['cpus']} CPUs; commit {env['commit']}", ""]
    lines += markdown_table(["step", "status", "seconds", "budget (s)", "reason"],
                            [[n, r["status"].upper(), r.get("seconds"), r.get("budget_s"), r["reason"]]
                             for n, r in results.items()])
    for result in results.values():
        if result["tables"] or result["notes"]:
            lines += _step_section(result)
    return "\n".join(lines) + "\n"


def write(out: Path, env: dict, results: dict[str, dict], time_limit: float) -> None:
    body = {"environment": env, "time_limit_s": time_limit, "failed": any_failed(results),
            "steps": list(results.values())}
    (out / "report.json").write_text(json.dumps(body, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(env, results))
