"""The checkout's scripts: the GPU check (``bash scripts/gpu_check.sh``, which runs ``python -m scripts.gpu_check``
with the repository root on ``PYTHONPATH``) and its steps, imported as ``scripts.gpu_check_*``."""
