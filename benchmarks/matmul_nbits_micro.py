"""onnxruntime MatMulNBits on one layer shape against the fp32 MatMul: zero-point variants and accuracy levels
(docs/quantized-target.md#mapping). Random weights; times per call in microseconds, medians of 5 rounds of 20 calls.

    python -m benchmarks.matmul_nbits_micro [THREADS]

kinds: fp32 (MatMul), nozp (default zero point), zp_u8 (packed uint8 zero points), zp_f (float zero points);
/a0: fp32 compute, /a4: int8 compute (accuracy_level 4).
"""
import numpy as np, onnxruntime as ort, time, sys
from onnx import helper, TensorProto, numpy_helper
rng = np.random.default_rng(0)
def model(K, N, kind, acc, bits=4, blk=32):
    kb = K // blk
    inits = []; nodes = []
    if kind == "fp32":
        inits.append(numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "W"))
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["y"]))
    else:
        blob = blk * bits // 8
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (N, kb, blob), dtype=np.uint8), "B"))
        inits.append(numpy_helper.from_array(rng.random((N * kb,), dtype=np.float32) * 0.01, "S"))
        ins = ["x", "B", "S"]
        if kind == "zp_u8":
            inits.append(numpy_helper.from_array(np.zeros((N, (kb * bits + 7) // 8), np.uint8), "Z")); ins.append("Z")
        elif kind == "zp_f":
            inits.append(numpy_helper.from_array(rng.random((N * kb,), dtype=np.float32), "Z")); ins.append("Z")
        nodes.append(helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=blk, accuracy_level=acc))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    o = ort.SessionOptions(); o.intra_op_num_threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
for (K, N, bits) in [(576, 3072, 4), (1536, 576, 4), (576, 49152, 8), (576, 49152, 4)]:
    for M in (1, 8):
        res = {}
        sessions = {}
        for kind in ["fp32", "nozp", "zp_u8", "zp_f"]:
            for acc in ([0] if kind == "fp32" else [0, 4]):
                if kind == "zp_f" and N > 10000: continue
                sessions[(kind, acc)] = model(K, N, kind, acc, bits)
        x = rng.standard_normal((M, K)).astype(np.float32)
        for r in range(5):
            for key, s in sessions.items():
                s.run(None, {"x": x})
                t = time.perf_counter()
                for _ in range(20): s.run(None, {"x": x})
                res.setdefault(key, []).append((time.perf_counter() - t) / 20 * 1e6)
        print(K, N, bits, "M", M, {f"{k[0]}/a{k[1]}": round(float(np.median(v)), 1) for k, v in res.items()}, flush=True)
