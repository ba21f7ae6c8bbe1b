"""The mutation check (docs/testing.md#the-mutation-check): can the tests fail for the bugs they name?

Each mutant is a small textual patch (old string -> new string in a named file) that plants one bug the suite
claims to catch. The check copies the tree (tracked and untracked, not ignored, files: the working tree as it is)
to a temporary folder, applies one mutant there, never in the working tree, runs the test files that claim the
property it breaks, and prints a table: mutant -> each test file's failed / run tests. A mutant whose old string
does not occur exactly once in its file stops the check (the code moved: update the mutant);
``tests/test_mutation_check.py`` keeps that true in every run of the suite.

    python -m tests.mutation_check --list
    python -m tests.mutation_check --mutant accept_wrong_draft --tests tests/test_verify.py
    python -m tests.mutation_check                   # every mutant on its own test files (slow: minutes each)

Standard library only: it runs pytest in the copy with this Python (``sys.executable``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Patch:
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    patches: tuple[Patch, ...]
    tests: tuple[str, ...]  # the test files that claim the property it breaks: each must fail


QUANTIZED = ("tests/test_quantized_target.py", "tests/test_int4_target.py")  # lossless on 4- and 8-bit engines
EXACT = ("tests/test_cpu_target.py", "tests/test_quantized_target.py")  # the exact int8 target's bitwise invariance
DEVICE = ("tests/test_device_step.py",)  # the decode step on the device (docs/gpu-engine.md)
DECODE = ("tests/test_lossless.py", "tests/test_kv_cache.py", *QUANTIZED, *DEVICE)  # the decode loop, its KV cache

MUTANTS = (
    Mutant("accept_wrong_draft", "greedy verification accepts every depth-1 draft, right or wrong",
           (Patch("clover/verify.py", "| (parents < 0)", "| (parents <= 0)"),
            Patch("clover/device_step.py", "| (tree.parents < 0)", "| (tree.parents <= 0)")),
           ("tests/test_verify.py", "tests/test_lossless.py", *QUANTIZED, *DEVICE)),
    Mutant("commit_only_root", "a decode step commits only the root's K/V, not the accepted drafts'",
           (Patch("clover/decode.py", "cpu_tensor([len(a.path) for a in accepted]))",
                  "cpu_tensor([1 for a in accepted]))"),
            Patch("clover/device_step.py", "    commit(keys, values, past_lengths, accepted.path)",
                  "    commit(keys, values, past_lengths, accepted.path[:, :1])")),
           DECODE),
    Mutant("drop_commit", "a decode step commits no K/V at all",
           (Patch("clover/decode.py", "        self.cache.commit(result.present_keys, result.present_values, source,\n"
                                      "                          cpu_tensor([len(a.path) for a in accepted]))\n",
                  "        pass  # mutant: the step's K/V are not committed\n"),
            Patch("clover/device_step.py", "    commit(keys, values, past_lengths, accepted.path)",
                  "    pass  # mutant: the step's K/V are not committed")),
           DECODE),
    Mutant("device_calibration_frozen", "the device step scores suffix candidates by its calibration but never "
                                        "updates it from acceptance",
           (Patch("clover/device_step.py",
                  "        self.predicted.copy_(torch.where(seen, self.decay * self.predicted + predicted, "
                  "self.predicted))\n"
                  "        self.accepted.copy_(torch.where(seen, self.decay * self.accepted + accepted, self.accepted))\n",
                  "        pass  # mutant: the calibration is never updated\n"),),
           DEVICE),
    Mutant("device_shared_path_twice", "the device tree keeps a path both the heads and the suffix propose as two "
                                       "nodes, as the host does not",
           (Patch("clover/device_step.py", "            same[..., 0] = False  # the root is nobody's duplicate\n",
                  "            same[...] = False  # mutant: nothing merges\n"),),
           DEVICE),
    Mutant("rope_base_doubled", "the RoPE base doubled in both the torch and the ONNX target: vanilla and "
                                "speculative decoding share the bug, only an independent reference sees it",
           (Patch("clover/target.py", "self.config.head_dim, self.config.rope_theta,",
                  "self.config.head_dim, 2 * self.config.rope_theta,"),
            Patch("clover/export/onnx_graph.py", "_rope(g, names[1], cfg.head_dim, cfg.rope_theta)",
                  "_rope(g, names[1], cfg.head_dim, 2 * cfg.rope_theta)"),
            Patch("clover/export/onnx_graph.py", "_RotaryCache(g, cfg.head_dim, cfg.rope_theta, max_positions)",
                  "_RotaryCache(g, cfg.head_dim, 2 * cfg.rope_theta, max_positions)")),
           ("tests/test_kv_cache.py", *QUANTIZED, "tests/test_export.py", "tests/test_cli.py", *DEVICE)),
    Mutant("prefill_commits_padding", "the prefill commits every row's K/V up to the batch's widest prompt, "
                                      "padding included",
           (Patch("clover/decode.py", "torch.arange(width).expand(batch, -1), lengths, rows=rows)",
                  "torch.arange(width).expand(batch, -1), torch.full_like(lengths, width), rows=rows)"),),
           DECODE),
    Mutant("stop_words_decoded_before_refusal", "the server decodes every stop word before it checks their "
                                                "count (work done before a refusal)",
           (Patch("clover/serving/protocol.py", "    if len(words) > limits.max_stop_words:\n",
                  "    [bytes(w).decode('utf-8', 'replace') for w in words if isinstance(w, (bytes, np.bytes_))]\n"
                  "    if len(words) > limits.max_stop_words:\n"),),
           ("tests/test_serving_faults.py",)),
    Mutant("drain_cuts_at_once", "the OpenAI frontend's shutdown drain expires at once instead of after drain_s",
           (Patch("clover/serving/openai_frontend.py", "self.loop.call_later(self.drain_s, self.expired.set)",
                  "self.loop.call_soon(self.expired.set)"),),
           ("tests/test_openai_frontend.py",)),
    Mutant("burst_prefilled_at_once", "a step admits every waiting request, ignoring max_step_tokens",
           (Patch("clover/decode.py", "len(self._running), self.max_step_tokens)", "len(self._running), None)"),),
           ("tests/test_scheduling.py",)),
    Mutant("first_tokens_after_decode", "the batcher sends a step's first tokens only after its decode pass",
           (Patch("clover/serving/batcher.py", "events = self.decoder.step(on_prefill=self._take_events)",
                  "events = self.decoder.step()"),),
           ("tests/test_scheduling.py",)),
    Mutant("cpu_target_one_row_kernel", "the exact int8 target's matmul rounds a lone row's Q4_1 minimum term "
                                        "otherwise than a row in a tile of several (as MLAS's M = 1 kernel does)",
           (Patch("clover/kernels/cpu_target.cpp",
                  "      mins[r] = _mm256_fmadd_ps(block.m, _mm256_set1_ps(xs[r]), mins[r]);",
                  "      mins[r] = R == 1 ? _mm256_add_ps(mins[r], _mm256_mul_ps(block.m, _mm256_set1_ps(xs[r])))"
                  " : _mm256_fmadd_ps(block.m, _mm256_set1_ps(xs[r]), mins[r]);"),),
           EXACT),
    Mutant("cpu_target_tile_float_order", "the exact int8 target's many-row tiles of Q8_0 blocks (the LM head) "
                                          "scale the integer sums by the activation scale first, where one row "
                                          "scales the weight scale",
           (Patch("clover/kernels/cpu_target.cpp",
                  "xsum[r]));\n      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(block.d, _mm256_set1_ps(xd[r])), sums, acc[r]);",
                  "xsum[r]));\n      acc[r] = R == 1 ? _mm256_fmadd_ps(_mm256_mul_ps(block.d, _mm256_set1_ps(xd[r])), sums, "
                  "acc[r]) : _mm256_fmadd_ps(block.d, _mm256_mul_ps(_mm256_set1_ps(xd[r]), sums), acc[r]);"),
            Patch("clover/kernels/cpu_target.cpp",
                  "      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r])), sums, acc[r]);\n    }\n  }\n"
                  "  for (int r = 0; r < R; ++r) store_pair(out + (r0 + r) * ldo + g * kGroup, acc[r],",
                  "      acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(_mm512_set1_ps(xd[r]), sums), acc[r]);\n    }\n  }\n"
                  "  for (int r = 0; r < R; ++r) store_pair(out + (r0 + r) * ldo + g * kGroup, acc[r],")),
           EXACT),
    Mutant("cpu_target_keys_in_slot_order", "the exact int8 target's attention reduces over a row's in-flight keys "
                                            "in reverse slot order, not in their logical (depth) order",
           (Patch("clover/kernels/cpu_target.cpp", "  for (int j = 0; j < tokens; ++j)\n    if ((static_cast",
                  "  for (int j = tokens - 1; j >= 0; --j)\n    if ((static_cast"),),
           EXACT),
)
BY_NAME = {m.name: m for m in MUTANTS}


class MutantRotted(RuntimeError):
    """A mutant's old string is not in its file exactly once: the code moved, the mutant must follow it."""


def apply(mutant: Mutant, root: Path) -> None:
    """Patch the tree at ``root`` (a copy: never call this on the working tree)."""
    if root.resolve() == ROOT:
        raise RuntimeError("refusing to mutate the working tree")
    for patch in mutant.patches:
        file = root / patch.path
        text = file.read_text()
        if text.count(patch.old) != 1:
            raise MutantRotted(f"{mutant.name}: {patch.old!r} occurs {text.count(patch.old)} times in {patch.path}, "
                               "not once (the code moved: update tests/mutation_check.py)")
        file.write_text(text.replace(patch.old, patch.new))


def copy_tree(dest: Path) -> Path:
    """The working tree's tracked and untracked (not ignored) files, copied to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a deleted but still tracked file is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _environment(copy: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def _check_imports_the_copy(copy: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import clover; print(clover.__file__)"], cwd=copy,
                         env=_environment(copy), check=True, capture_output=True, text=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(copy.resolve()):
        raise RuntimeError(f"the copy imports clover from {out}, not from itself: the check would test nothing")


def run_tests(copy: Path, tests: list[str], extra: list[str]) -> dict[str, tuple[int, int]]:
    """Run ``tests`` in ``copy``: {test file: (failed or errored, run)} from pytest's JUnit report."""
    report = copy / "mutation-report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    *extra, *tests], cwd=copy, env=_environment(copy), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    counts: dict[str, list[int]] = {test.split("::")[0]: [0, 0] for test in tests}
    if not report.exists():
        return {name: (-1, 0) for name in counts}  # pytest did not even start
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        dotted = case.get("classname", "")  # tests.test_x, or tests.test_x.TestClass
        name = next((test for test in counts if (dotted + ".").startswith(test.removesuffix(".py").replace("/", ".")
                                                                          + ".")), dotted)
        failed = case.find("failure") is not None or case.find("error") is not None
        entry = counts.setdefault(name, [0, 0])
        entry[0] += failed
        entry[1] += 1
    report.unlink()
    return {name: (failed, run) for name, (failed, run) in counts.items()}


def check(mutant: Mutant | None, tests: list[str], extra: list[str]) -> dict[str, tuple[int, int]]:
    """One mutant (None: the unmutated tree, a baseline) on a fresh copy of the tree."""
    with tempfile.TemporaryDirectory(prefix="clover-mutant-") as tmp:
        copy = copy_tree(Path(tmp))
        if mutant is not None:
            apply(mutant, copy)
        _check_imports_the_copy(copy)
        return run_tests(copy, tests, extra)


def _verdict(mutant: Mutant | None, test_file: str, failed: int, run: int) -> str:
    """caught / MISSED for a file that claims the property the mutant breaks; for any other file (``--tests``)
    only whether it fails, as it need not."""
    if failed < 0 or run == 0:
        return "NOT RUN"
    if mutant is None:
        return "ok" if failed == 0 else "BASELINE FAILS"
    if test_file not in mutant.tests:
        return "fails (no claim)" if failed else "passes (no claim)"
    return "caught" if failed else "MISSED"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.mutation_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutants and their test files, run nothing")
    p.add_argument("--mutant", action="append", choices=sorted(BY_NAME), help="this mutant (repeatable; "
                   "default: all)")
    p.add_argument("--tests", nargs="+", help="these test files or node ids instead of each mutant's own")
    p.add_argument("--baseline", action="store_true", help="first run the tests on the unmutated copy")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. \"-m 'not slow' -x\"")
    args = p.parse_args(argv)
    mutants = [BY_NAME[name] for name in args.mutant] if args.mutant else list(MUTANTS)
    if args.list:
        for m in mutants:
            print(f"{m.name}: {m.bug}\n    patches: {', '.join(sorted({x.path for x in m.patches}))}\n"
                  f"    tests:   {' '.join(m.tests)}")
        return 0
    for m in mutants:  # every mutant applies before anything runs (fails loudly if the code moved)
        with tempfile.TemporaryDirectory() as tmp:
            for patch in m.patches:
                (Path(tmp) / patch.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / patch.path, Path(tmp) / patch.path)
            apply(m, Path(tmp))
    extra = args.pytest_args.split() if args.pytest_args else []
    rows = []
    for m in ([None] if args.baseline else []) + mutants:
        tests = args.tests or (sorted({t for x in mutants for t in x.tests}) if m is None else list(m.tests))
        print(f"running {m.name if m else '(no mutant)'} on {' '.join(tests)} ...", file=sys.stderr, flush=True)
        for name, (failed, run) in check(m, tests, extra).items():
            rows.append((m.name if m else "(no mutant)", name, failed, run, _verdict(m, name, failed, run)))
    width = max(len(r[0]) for r in rows)
    files = max(len(r[1]) for r in rows)
    print(f"{'mutant':<{width}}  {'test file':<{files}}  failed / run  verdict")
    for name, file, failed, run, verdict in rows:
        print(f"{name:<{width}}  {file:<{files}}  {max(failed, 0):>6} / {run:<3}  {verdict}")
    return 1 if any(r[4] in ("MISSED", "BASELINE FAILS") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
