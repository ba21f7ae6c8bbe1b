"""One-off probes and analyses around the heads pipeline (``training/``): each answers one question a result in
docs/results asked, and none is a stage of the pipeline.

    bf16_agreement.py  how often bf16 decoding, vanilla and Clover, keeps the fp32 reference's tokens
    cost_probe.py      per-token time and memory of the target's forward and one training step (docs/train-your-own.md)
    depth_probe.py     acceptance per tree depth and the trees built, against the greedy output
    device_tree_tau.py tau of the same greedy decoding with trees built on the host or by the device step
    diagnose_heads.py  how heads use their given token (state norms, token path, sensitivity, agreement)
    paired_tau.py      a per-question paired comparison of two heads' MT-bench tau with a sign test
    recipe_curve.py    teacher-forced agreement against training tokens, one line per recipe
    snapshot_heads.py  the heads of an unfinished run's last checkpoint, to evaluate or try them mid-run
    throughput_sweep.py training throughput over a grid of batch sizes, autocast and target dtypes (issue 47)

They run as modules from the repository root: ``python -m training.experiments.<name>``. They import the
pipeline (``training.train``, ``training.evaluate`` ...); the pipeline never imports them
(tests/test_code_health.py).
"""

from __future__ import annotations

import argparse


def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is ``doc``'s first paragraph and whose epilog is the rest, as written."""
    first, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=first, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
