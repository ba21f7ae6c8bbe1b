"""Int8 weights for the draft step (onnxruntime): cheaper drafting, unchanged output.

On a CPU a draft step at small batch is bound by reading its weights, and
nearly all of them are the shared LM head (``[V, H]``: 113 MB in fp32 for the
demo target, against about 8 MB of heads). Dynamic int8 quantization
(``onnxruntime.quantization.quantize_dynamic``: per-output-channel int8
weights, activations quantized per call) reads a quarter of the bytes.

With a draft vocabulary (docs/drafter.md#draft-vocabulary) the draft logits
multiply ``draft_lm_head.weight``, its ``[H, V']`` rows stored as their own
initializer, so only those V' rows are quantized and read (the full ``[V, H]``
table stays fp32 for the regressive embedding, a Gather of N rows).

Only the drafter's proposals can change, never what the target accepts, so
decoding stays lossless; the target graph is not touched.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np


def fold_weight_transposes(model) -> int:
    """Replace ``Transpose(initializer)`` nodes with a transposed initializer, in place.

    ``quantize_dynamic`` quantizes a MatMul only when its weight is an initializer; the
    draft step multiplies by ``Transpose(lm_head.weight)`` because the same ``[V, H]``
    table also serves the regressive token embedding (a Gather of rows). Returns the
    number of nodes folded.
    """
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    folded = 0
    for node in list(model.graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        weight = numpy_helper.to_array(inits[node.input[0]])
        name = f"{node.input[0]}.transposed"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)), name))
        for other in model.graph.node:
            for i, value in enumerate(other.input):
                if value == node.output[0]:
                    other.input[i] = name
        model.graph.node.remove(node)
        folded += 1
    return folded


def quantize_draft_step(path: str | Path) -> dict:
    """Rewrite ``path`` (``draft_step.onnx`` and its ``.data``) with int8 MatMul weights.

    Returns what was done, for ``engine.json``: ``{"method", "quantized_matmuls", "bytes"}``.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    path = Path(path)
    work = Path(tempfile.mkdtemp(prefix=".quantize-", dir=path.parent))
    try:
        model = onnx.load(str(path))
        fold_weight_transposes(model)
        folded = work / "folded" / path.name
        folded.parent.mkdir()
        onnx.save(model, str(folded), save_as_external_data=True, location=path.name + ".data")
        del model
        quantized = work / "quantized" / path.name
        quantized.parent.mkdir()
        # DefaultTensorType: where shape inference cannot type a MatMul's output (after onnxruntime's own
        # RotaryEmbedding op, in Clover-2's draft_prefill graph: benchmarks/draft_prefill_int8.py) it is float
        with _without_preprocessing_advice():
            quantize_dynamic(str(folded), str(quantized), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"], use_external_data_format=True,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        count = sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")
                    for n in onnx.load(str(quantized), load_external_data=False).graph.node)
        if not count:
            raise RuntimeError(f"{path}: no MatMul weight was quantized")
        for file in quantized.parent.iterdir():  # the .onnx and the .data it names
            shutil.move(str(file), str(path.parent / file.name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = path.stat().st_size + (path.parent / (path.name + ".data")).stat().st_size
    return {"method": "onnxruntime dynamic int8, per channel", "quantized_matmuls": count, "bytes": size}


# the start of what quantize_dynamic logs (through the root logger) for a model without its pre-processing metadata
PREPROCESSING_ADVICE = "Please consider to run pre-processing before quantization"


@contextlib.contextmanager
def _without_preprocessing_advice():
    """Drop onnxruntime's advice to pre-process the model while quantizing. Its pre-processing (symbolic shape
    inference and graph optimisation for quantization) does not apply to the draft step: every MatMul weight
    is an initializer already (fold_weight_transposes), and quantize_draft_step checks that they were
    quantized, so the line printed during every engine build only looked like a fault."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(PREPROCESSING_ADVICE)

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)
