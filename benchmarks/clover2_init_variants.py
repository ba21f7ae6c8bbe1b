"""Clover-2 starting points compared after the same few training steps (docs/results/clover2/README.md).

    python benchmarks/clover2_init_variants.py STEPS VARIANT [VARIANT ...]

VARIANT: ``current`` (Clover2Drafter as implemented), ``normed-input`` (the token mixer reads the
RMS-normalised last hidden state), ``normed-wv-identity`` (that, plus Wv = I + noise), ``wv-identity``.
Needs the ShareGPT caches of training/sharegpt_pipeline.sh (outputs/data/cache/sharegpt-{train,eval}).
Prints, per variant, top-1 against the label and agreement with the target's top-1 on 12 held-out
conversations.
"""
import sys, torch, time
sys.path.insert(0, "training")
from train import run_batch, collate, head_weights, make_plan
from hidden_cache import HiddenCache
from clover.demo import resolve_target
from clover.target import load_target
from clover.drafters import Drafter, new_drafter_config, RMSNorm
torch.set_num_threads(2)
target = load_target(resolve_target("demo", None))
train_cache = HiddenCache("outputs/data/cache/sharegpt-train")
eval_cache = HiddenCache("outputs/data/cache/sharegpt-eval")
lm = target.lm_head.weight.detach().float()
plan = make_plan(train_cache.conversations, 3072, 1, 0, max_tokens=None)[: int(sys.argv[1])]
eval_batch = collate(eval_cache, list(range(12)), False, True)
def variant(name):
    torch.manual_seed(0)
    d = Drafter.from_target(new_drafter_config("clover2", 3, target), target).float()
    if name == "normed-input":
        norm = RMSNorm(576, 1e-5); norm.requires_grad_(False)
        inner = d.token_mixer.forward
        d.token_mixer.forward = lambda h, e: inner(norm(h), e)
    if name == "normed-wv-identity":
        norm = RMSNorm(576, 1e-5); norm.requires_grad_(False)
        inner = d.token_mixer.forward
        d.token_mixer.forward = lambda h, e: inner(norm(h), e)
        with torch.no_grad():
            d.token_mixer.v_proj.weight.add_(torch.eye(576)); d.rnn.v_proj.weight.add_(torch.eye(576))
    if name == "wv-identity":
        with torch.no_grad():
            d.token_mixer.v_proj.weight.add_(20 * torch.eye(576)); d.rnn.v_proj.weight.add_(20 * torch.eye(576))
    return d
for name in sys.argv[2:]:
    d = variant(name).train()
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    t0 = time.time()
    for idx in plan:
        opt.zero_grad()
        run_batch(d, target, lm, collate(train_cache, idx, False, True), row_chunk=1024, weights=head_weights(3, 0.7), train=True, labels="hard")
        torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step()
    d.eval()
    with torch.no_grad():
        st = run_batch(d, target, lm, eval_batch, row_chunk=1024, weights=head_weights(3, 0.7), train=False, labels="hard")
    print(name, "steps", len(plan), "eval top1", [round(h / max(c, 1), 3) for h, c in zip(st["hits"][1], st["count"])],
          "agree", [round(h / max(c, 1), 3) for h, c in zip(st["agree"][1], st["count"])], f"{time.time()-t0:.0f}s", flush=True)
