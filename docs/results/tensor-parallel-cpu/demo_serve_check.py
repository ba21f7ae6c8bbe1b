import json, os, signal, subprocess, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from clover.client import GrpcClient, collect
from clover.serving.server import free_ports
http, grpc, metrics, master = free_ports(4)
t0 = time.time()
proc = subprocess.Popen([sys.executable, "-m", "clover.cli", "serve", "--engine", "demo", "--backend", "torch",
    "--tensor-parallel", "2", "--master-port", str(master), "--http-port", str(http), "--grpc-port", str(grpc),
    "--metrics-port", str(metrics), "--log-file", "/tmp/tp56/demo_serve.log"])
while True:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2).status == 200: break
    except OSError: time.sleep(1)
print("ready after", round(time.time() - t0), "s", flush=True)
prompts = [json.loads(l)["prompt"] for l in open("bench.jsonl")]
ref = [json.loads(l)["token_ids"] for l in open("out-vanilla-1-1-3.jsonl")]
def answer(p):
    c = GrpcClient(f"127.0.0.1:{grpc}", "clover")
    try: return collect(c.stream(p, 64)).token_ids
    finally: c.close()
t0 = time.time()
with ThreadPoolExecutor(8) as pool:
    got = list(pool.map(answer, prompts + prompts))
print("8 streams in", round(time.time() - t0, 1), "s; equal to TP=1 generate:", got == ref + ref, [g == r for g, r in zip(got, ref + ref)], flush=True)
proc.send_signal(signal.SIGINT)
print("exit", proc.wait(120))
