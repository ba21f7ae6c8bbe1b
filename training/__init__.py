"""Training pipeline for Clover / Medusa heads (issue 4).

Stages, one command each (see ``training/README.md``)::

    data.py          offline prompt set in task categories, train/eval split
    distill.py       the target answers every prompt (self-distillation), resumable
    hidden_cache.py  one frozen-target pass -> memory-mapped fp16 hidden states
    train.py         heads training with checkpoints and exact resume; torchrun for several processes
                     (distributed.py), the target on the fly with --features online (features.py)
    evaluate.py      teacher-forced per-head accuracy + accepted tokens per step
    ship_heads.py    trained heads packaged with a model card (decay_branch.py: a run's checkpoint annealed first)

The stages run as modules from the repository root: ``python -m training.<stage>`` (they import ``clover``
and ``training`` as packages; none edits ``sys.path``). Beside them: ``training/experiments/`` (one-off probes,
``python -m training.experiments.<name>``; the pipeline never imports them) and ``training/recipes/`` (shell
recipes that chain the stages: ``bash training/recipes/<name>.sh``).
"""
