"""Clover-2 starting points compared after the same few training steps (docs/results/clover2/README.md).

    python -m benchmarks.clover2_init_variants STEPS VARIANT [VARIANT ...]

VARIANT: ``current`` (Clover2Drafter as implemented: the mixer reads the RMS-normalised last hidden state,
head 1 reads ``[state; e(root token)]``), ``raw-input`` (the mixer reads the raw last hidden state, as in the
public code), ``state-only-head1`` (head 1 reads the state alone, as in the public code: the embedding half of
``first_head`` is zero and stays zero), ``public`` (both). ``--draft-vocab DIR`` trains and scores over that
draft vocabulary (16,384 ids).
Needs the ShareGPT caches of training/recipes/sharegpt_pipeline.sh (outputs/data/cache/sharegpt-{train,eval}).
Prints, per variant, top-1 against the label and agreement with the target's top-1 on 12 held-out
conversations.
"""
import sys, torch, time
from training.batches import collate, make_plan
from training.forward import head_weights, run_batch
from training.hidden_cache import HiddenCache
from clover.demo import resolve_target
from clover.target import load_target
from clover.drafters import Drafter, new_drafter_config, read_draft_vocab, set_draft_vocab
torch.set_num_threads(2)
VOCAB = None
if "--draft-vocab" in sys.argv:
    at = sys.argv.index("--draft-vocab")
    VOCAB = read_draft_vocab(sys.argv[at + 1], 16384)
    del sys.argv[at: at + 2]
target = load_target(resolve_target("demo", None))
train_cache = HiddenCache("outputs/data/cache/sharegpt-train")
eval_cache = HiddenCache("outputs/data/cache/sharegpt-eval")
lm = target.lm_head.weight.detach().float()
plan = make_plan(train_cache.conversations, 3072, 1, 0, max_tokens=None)[: int(sys.argv[1])]
eval_batch = collate(eval_cache, list(range(12)), False, True)
def variant(name):
    torch.manual_seed(0)
    d = Drafter.from_target(new_drafter_config("clover2", 3, target), target).float()
    if name in ("raw-input", "public"):
        d.input_norm = torch.nn.Identity()
    if name in ("state-only-head1", "public"):
        with torch.no_grad():
            d.first_head.weight[:, d.config.hidden_size:].zero_()
        mask = torch.ones_like(d.first_head.weight)
        mask[:, d.config.hidden_size:] = 0
        d.first_head.weight.register_hook(lambda grad: grad * mask)
    if VOCAB is not None:
        set_draft_vocab(d, VOCAB)
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
