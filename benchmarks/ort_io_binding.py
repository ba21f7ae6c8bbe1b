#!/usr/bin/env python
"""Does onnxruntime's I/O binding cut the host cost of a ``target`` call? (issue 14, part 3)

The cost in question is the call's overhead, a fraction of a millisecond against a target pass of tens of
milliseconds that varies by more than that from call to call. So the variants run on a stand-in model with the
engine's exact inputs and outputs (names, dtypes, shapes: 4 step inputs, the KV cache of every layer; logits
``[B, T, V]``, h0, the new K/V of every layer) and no compute but filling its outputs. Measured per call, in CPU
time of the calling thread, alternating the variants:

* ``run``: the backend as it is (``InferenceSession.run``, KV-cache feeds kept while the cache views stay);
* ``run, feeds per call``: the backend's ``target`` before it kept its feeds (a frozen copy, below);
* ``binding``: I/O binding, inputs bound by pointer (the cache only when it moved), outputs allocated by
  onnxruntime per call (bound again every call: a bound output is otherwise overwritten by the next run);
* ``binding, kept outputs``: outputs bound once per shape to buffers the engine keeps, so a call's results
  are overwritten by the next call of the same shape (a change to what ``target`` returns).

Usage::

    python -m benchmarks.ort_io_binding --engine engines/demo --repeats 400
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from clover.attention import pack_mask
from clover.backends.onnxruntime import OnnxRuntimeEngine, open_session
from clover.engine_contract import TargetResult, cache_input_names, present_output_names
from clover.engine_dir import engine_spec, read_engine_meta

NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
STEP_INPUTS = ("input_ids", "position_ids", "past_lengths", "spec_decoding_packed_mask")


def stand_in_model(spec, path: Path) -> None:
    """A graph with the target's inputs and outputs whose only work is filling the outputs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    fill = helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])
    consts = {"V": spec.vocab_size, "H": spec.hidden_size, "Hkv": spec.num_kv_heads, "D": spec.head_dim, "i0": 0,
              "i1": 1, "i2": 2}
    inits = [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in consts.items()]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "t"]),
              helper.make_tensor_value_info("past_lengths", TensorProto.INT32, ["b"]),
              helper.make_tensor_value_info("spec_decoding_packed_mask", TensorProto.INT32, ["b", "t", "w"])]
    nodes = [helper.make_node("Shape", ["input_ids"], ["bt"]), helper.make_node("Slice", ["bt", "i0", "i1"], ["b"]),
             helper.make_node("Slice", ["bt", "i1", "i2"], ["t"]),
             helper.make_node("Concat", ["bt", "V"], ["s_logits"], axis=0),
             helper.make_node("ConstantOfShape", ["s_logits"], ["logits"], value=fill),
             helper.make_node("Concat", ["bt", "H"], ["s_h0"], axis=0),
             helper.make_node("ConstantOfShape", ["s_h0"], ["h0"], value=fill),
             helper.make_node("Concat", ["b", "Hkv", "t", "D"], ["s_present"], axis=0)]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", spec.vocab_size]),
               helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["b", "t", spec.hidden_size])]
    cache_shape = ["b", spec.num_kv_heads, "s", spec.head_dim]
    for past, present in zip(cache_input_names(spec.num_kv_layers), present_output_names(spec.num_kv_layers)):
        inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, cache_shape))
        nodes.append(helper.make_node("Size", [past], [f"n_{past}"]))  # reads the input, keeps it in the graph
        nodes.append(helper.make_node("ConstantOfShape", ["s_present"], [present], value=fill))
        outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT, ["b", spec.num_kv_heads, "t",
                                                                                  spec.head_dim]))
    graph = helper.make_graph(nodes, "stand_in", inputs, outputs, initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


class Binding:
    """``target`` through I/O binding; ``keep_outputs``: outputs bound once per shape (see the module doc)."""

    def __init__(self, engine: OnnxRuntimeEngine, keep_outputs: bool) -> None:
        self.engine, self.keep_outputs = engine, keep_outputs
        self.binding = engine.target_session.io_binding()
        self.cache_key = self.output_shape = None

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        self.binding.bind_input(name, "cpu", 0, NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        engine, binding = self.engine, self.binding
        cache = [t for pair in zip(k_cache, v_cache) for t in pair]
        key = tuple(t.data_ptr() for t in cache) + tuple(cache[0].shape)
        if key != self.cache_key:
            for name, tensor in zip(engine._cache_names, cache):
                self.bind(name, tensor)
            self.cache_key = key
        step = (input_ids, position_ids, past_lengths.to(torch.int32), packed_mask)
        step = [t.contiguous() for t in step]  # alive until the run
        for name, tensor in zip(STEP_INPUTS, step):
            self.bind(name, tensor)
        outputs = self._bind_outputs(input_ids.shape, cache[0])
        engine.target_session.run_with_iobinding(binding)
        if outputs is None:
            outputs = [torch.from_numpy(value.numpy()) for value in binding.get_outputs()]
        return TargetResult(outputs[0], outputs[1], outputs[2::2], outputs[3::2])

    def _bind_outputs(self, shape, cache) -> list | None:
        batch, tokens = shape
        if not self.keep_outputs:
            self.binding.clear_binding_outputs()
            for name in self.engine._target_outputs:
                self.binding.bind_output(name, "cpu")
            return None
        if (batch, tokens) != self.output_shape:
            spec = self.engine.spec
            present = (batch, cache.shape[1], tokens, cache.shape[3])
            self.kept = [torch.empty(batch, tokens, spec.vocab_size), torch.empty(batch, tokens, spec.hidden_size),
                         *(torch.empty(present) for _ in self.engine._present_names)]
            for name, tensor in zip(self.engine._target_outputs, self.kept):
                self.binding.bind_output(name, "cpu", 0, np.float32, list(tensor.shape), tensor.data_ptr())
            self.output_shape = (batch, tokens)
        return self.kept


def previous_target(engine, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
    """Frozen: ``OnnxRuntimeEngine.target`` before it kept its KV-cache feeds."""
    feeds = {
        "input_ids": input_ids.contiguous().numpy(),
        "position_ids": position_ids.contiguous().numpy(),
        "past_lengths": past_lengths.to(torch.int32).contiguous().numpy(),
        "spec_decoding_packed_mask": packed_mask.contiguous().numpy(),
    }
    for i, (k, v) in enumerate(zip(k_cache, v_cache)):
        feeds[engine._cache_names[2 * i]] = k.numpy()
        feeds[engine._cache_names[2 * i + 1]] = v.numpy()
    outputs = [torch.from_numpy(o) for o in engine.target_session.run(engine._target_outputs, feeds)]
    presents = outputs[2:]
    return TargetResult(outputs[0], outputs[1], presents[0::2], presents[1::2])


def step_inputs(spec, batch: int, tokens: int, max_seq: int):
    cache = torch.zeros(spec.num_kv_layers, batch, spec.num_kv_heads, max_seq, spec.head_dim)
    past = torch.full((batch,), 100, dtype=torch.int32)
    ids = torch.zeros(batch, tokens, dtype=torch.long)
    mask = pack_mask(torch.ones(batch, tokens, tokens, dtype=torch.bool).tril())
    return cache, (ids, past[:, None].long() + torch.arange(tokens), past, mask)


def measure(engine_dir: str, shapes: list[tuple[int, int]], repeats: int) -> None:
    meta = read_engine_meta(Path(engine_dir))
    spec = engine_spec(meta)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "stand_in.onnx"
        stand_in_model(spec, model)
        engine = OnnxRuntimeEngine.__new__(OnnxRuntimeEngine)  # the backend's own code on the stand-in session
        engine.spec, engine.target_session = spec, open_session(model, None)
        engine._cache_names = cache_input_names(spec.num_kv_layers)
        engine._present_names = present_output_names(spec.num_kv_layers)
        engine._target_outputs = ["logits", "h0", *engine._present_names]
        engine._cache_feeds, engine.run_seconds = ([], {}), 0.0
        fresh = Binding(engine, keep_outputs=False)
        kept = Binding(engine, keep_outputs=True)
        for batch, tokens in shapes:
            cache, step = step_inputs(spec, batch, tokens, spec.max_seq_len)
            views = (list(cache.unbind(0)), list(cache.unbind(0)))
            variants = {"run": lambda: engine.target(*step, list(views[0]), list(views[1])),
                        "run, feeds per call": lambda: previous_target(engine, *step, *views),
                        "binding": lambda: fresh.target(*step, *views),
                        "binding, kept outputs": lambda: kept.target(*step, *views)}
            expected = variants["run"]()
            for name, variant in variants.items():  # the same outputs from every variant
                got = variant()
                assert all(torch.equal(a, b) for a, b in zip((got.logits, *got.present_keys),
                                                            (expected.logits, *expected.present_keys))), name
            times = {name: [] for name in variants}
            for repeat in range(repeats):
                names = list(variants)
                for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                    start = time.thread_time()
                    variants[name]()
                    times[name].append(time.thread_time() - start)
            print(f"batch {batch}, {tokens} tokens (logits {batch * tokens * spec.vocab_size * 4 / 1e6:.1f} MB): "
                  f"CPU ms per call of the calling thread, median [min-max] of {repeats}")
            for name, values in times.items():
                ms = [1000 * v for v in values]
                print(f"  {name:22s} {statistics.median(ms):7.3f} [{min(ms):.3f}-{max(ms):.3f}]")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="engines/demo", help="engine directory (its engine.json gives the I/O)")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--shapes", default="1x5,1x1,32x5,32x1", help="BATCHxTOKENS, comma-separated")
    args = parser.parse_args(argv)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    measure(args.engine, shapes, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
