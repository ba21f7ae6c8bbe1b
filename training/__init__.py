"""Training pipeline for Clover / Medusa heads (issue 4).

Stages, one command each (see ``training/README.md``)::

    data.py          offline prompt set in task categories, train/eval split
    distill.py       the target answers every prompt (self-distillation), resumable
    hidden_cache.py  one frozen-target pass -> memory-mapped fp16 hidden states
    train.py         heads training with checkpoints and exact resume; torchrun for several processes
                     (distributed.py), the target on the fly with --features online (features.py)
    cost_probe.py    per-token time and memory of a training step (docs/train-your-own.md)
    evaluate.py      teacher-forced per-head accuracy + accepted tokens per step

The stages run as modules from the repository root: ``python -m training.<stage>`` (they import ``clover``
and ``training`` as packages; none edits ``sys.path``).
"""
