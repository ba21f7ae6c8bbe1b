"""Serving Clover from Triton Inference Server (docs/serving.md).

Everything here runs without ``triton_python_backend_utils``:

- :mod:`clover.serving.protocol`: the model's inputs and outputs (tensorrtllm_backend names),
  request validation, the ``config.pbtxt`` text.
- :mod:`clover.serving.batcher`: :class:`InflightBatcher`, a background decode thread that
  batches concurrent requests into shared decode steps and streams their text back.
- :mod:`clover.serving.triton_model`: the Python-backend model logic; ``triton_repo/clover/1/model.py``
  only forwards to it, passing the ``pb_utils`` module in.
- :mod:`clover.serving.repository`: writes a model repository pointed at an engine directory.
- :mod:`clover.serving.server`: finds ``tritonserver`` (system or the ``nvidia-pytriton`` wheel), launches it,
  waits for readiness, shuts it down cleanly.
- :mod:`clover.serving.hidden_args`: passes tritonserver its admin key off its command line.

The tritonclient side lives in :mod:`clover.client`.
"""
