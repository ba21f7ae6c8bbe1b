"""Build TensorRT plans from an engine directory's plugin-variant ONNX files.

Written against TensorRT 10's Python API; it has not run on the development
machines (no TensorRT there). One optimization profile per plan covers every
dynamic axis: batch 1..max_batch, new tokens 1..max_seq (prompt chunks and
trees), a fixed cache length max_seq, and draft nodes 1..max_batch*max_tree.
"""

from __future__ import annotations

from pathlib import Path

from clover.attention import num_mask_words
from clover.backends.tensorrt import load_tree_attention_plugin, require_tensorrt
from clover.config import ConfigError
from clover.engine_contract import cache_input_names, draft_cache_input_names


def target_profile(max_batch, max_tree, max_seq, num_kv_layers, num_kv_heads, head_dim) -> dict:
    """``{input: (min, opt, max)}`` shapes for ``target``; opt is one decode step with a 4-node tree."""
    opt_tokens = 5
    profile = {
        "input_ids": ((1, 1), (1, opt_tokens), (max_batch, max_seq)),
        "position_ids": ((1, 1), (1, opt_tokens), (max_batch, max_seq)),
        "past_lengths": ((1,), (1,), (max_batch,)),
        "spec_decoding_packed_mask": ((1, 1, 1), (1, opt_tokens, 1), (max_batch, max_seq, num_mask_words(max_seq))),
    }
    for name in cache_input_names(num_kv_layers):
        profile[name] = ((1, num_kv_heads, max_seq, head_dim), (1, num_kv_heads, max_seq, head_dim),
                         (max_batch, num_kv_heads, max_seq, head_dim))
    return profile


def draft_prefill_profile(max_batch, max_seq, hidden_size, num_draft_kv_layers, num_kv_heads, head_dim) -> dict:
    """``{input: (min, opt, max)}`` shapes for Clover-2's ``draft_prefill``: new positions 1..max_seq as for
    ``target`` (a prompt, or the positions accepted in one step: opt 2), the draft cache at max_seq."""
    opt_tokens = 2
    tokens = ((1, 1), (1, opt_tokens), (max_batch, max_seq))
    profile = {
        "hidden": tuple((*shape, hidden_size) for shape in tokens),
        "next_token": tokens,
        "position_ids": tokens,
        "past_lengths": ((1,), (1,), (max_batch,)),
        "spec_decoding_packed_mask": ((1, 1, 1), (1, opt_tokens, 1), (max_batch, max_seq, num_mask_words(max_seq))),
    }
    for name in draft_cache_input_names(num_draft_kv_layers):
        profile[name] = ((1, num_kv_heads, max_seq, head_dim), (1, num_kv_heads, max_seq, head_dim),
                         (max_batch, num_kv_heads, max_seq, head_dim))
    return profile


def draft_profile(max_batch, max_tree, hidden_size) -> dict:
    nodes = max_batch * max_tree
    return {"hidden": ((1, hidden_size), (4, hidden_size), (nodes, hidden_size)),
            "token": ((1,), (4,), (nodes,))}


def _build_one(trt, onnx_path: Path, plan_path: Path, profile_shapes: dict, fp16: bool) -> None:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name in profile_shapes:
            profile.set_shape(name, *profile_shapes[name])
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ConfigError(f"TensorRT failed to build a plan from {onnx_path.name} (see the log above)")
    plan_path.write_bytes(bytes(plan))


def build_plans(engine_dir: Path, *, dtype: str, max_batch: int, max_tree: int, max_seq: int, has_draft: bool,
                hidden_size: int, num_kv_layers: int, num_kv_heads: int, head_dim: int,
                num_draft_kv_layers: int = 0) -> dict:
    """Write ``target.plan`` (and ``draft_step.plan``, and ``draft_prefill.plan`` for a drafter with its own KV
    cache); returns the file entries for ``engine.json``."""
    trt = require_tensorrt()
    load_tree_attention_plugin()
    fp16 = dtype == "fp16"
    _build_one(trt, engine_dir / "target.onnx", engine_dir / "target.plan",
               target_profile(max_batch, max_tree, max_seq, num_kv_layers, num_kv_heads, head_dim), fp16)
    files = {"target_plan": "target.plan"}
    if has_draft:
        _build_one(trt, engine_dir / "draft_step.onnx", engine_dir / "draft_step.plan",
                   draft_profile(max_batch, max_tree, hidden_size), fp16)
        files["draft_step_plan"] = "draft_step.plan"
    if num_draft_kv_layers:
        _build_one(trt, engine_dir / "draft_prefill.onnx", engine_dir / "draft_prefill.plan",
                   draft_prefill_profile(max_batch, max_seq, hidden_size, num_draft_kv_layers, num_kv_heads, head_dim),
                   fp16)
        files["draft_prefill_plan"] = "draft_prefill.plan"
    return files
