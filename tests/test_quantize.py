"""clover.export.quantize on a one-MatMul graph: int8 weights, and a quiet build."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from clover.export.quantize import PREPROCESSING_ADVICE, quantize_draft_step


def _one_matmul(path) -> None:
    """``y = x @ W`` with ``W`` an initializer, saved with external data like the engine build's graphs."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "draft",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")


def test_quantizing_the_draft_step_does_not_print_onnxruntime_s_preprocessing_advice(tmp_path, caplog, capsys):
    path = tmp_path / "draft_step.onnx"
    _one_matmul(path)
    with caplog.at_level(logging.WARNING):
        done = quantize_draft_step(path)
    assert done["quantized_matmuls"] == 1
    said = caplog.text + "".join(capsys.readouterr())
    assert PREPROCESSING_ADVICE not in said, said
    assert not logging.getLogger().filters  # the filter is gone after the call
