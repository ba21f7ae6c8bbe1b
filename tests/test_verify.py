import numpy as np
import pytest
import torch

from clover.backends.torch import TorchEngine
from clover.config import ConfigError, SamplingConfig, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.tree import TokenTree, batch_trees
from clover.verify import greedy_accept, target_probs
from tests.conftest import make_drafter, make_target

scipy_stats = pytest.importorskip("scipy.stats")


def _one_hot_logits(next_tokens, vocab=8):
    logits = torch.zeros(1, len(next_tokens), vocab)
    for i, t in enumerate(next_tokens):
        logits[0, i, t] = 5.0
    return logits


def test_greedy_accepts_longest_matching_path():
    tree = TokenTree.root(1)
    a = tree.add(0, 3)  # target says 3 after root: accepted
    tree.add(0, 4)
    b = tree.add(a, 5)  # target says 6 after 3: rejected
    tree.add(a, 6)  # accepted
    batch = batch_trees([tree])
    # target next-token per node: root->3, a->6, (4)->0, b->0, (6)->2
    accepted = greedy_accept(_one_hot_logits([3, 6, 0, 0, 2]), batch)[0]
    assert accepted.path == [0, 1, 4]
    assert accepted.tokens == [3, 6, 2]
    # nothing matches: only the bonus token from the root
    accepted = greedy_accept(_one_hot_logits([7, 6, 0, 0, 2]), batch)[0]
    assert accepted.path == [0] and accepted.tokens == [7]
    assert b == 3


def test_target_probs_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and abs(float(p.sum()) - 1) < 1e-12
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token alone holds > 0.5
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.9))
    assert p[0] > 0 and p[1] > 0 and p[3] == 0
    with pytest.raises(ConfigError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ConfigError):
        SamplingConfig(top_p=0)


def _exact_two_token_distribution(target, prompt, sampling):
    """Joint P(x1, x2) from the target itself, by enumeration."""
    engine = TorchEngine(target, None)
    vocab = target.config.vocab_size
    decoder = SpeculativeDecoder(engine, "vanilla")
    from clover.attention import causal_packed_mask

    def next_probs(tokens):
        ids = torch.tensor([tokens])
        empty = [torch.zeros(1, target.config.num_kv_heads, 0, target.config.head_dim)] * target.config.num_layers
        out = engine.target(ids, torch.arange(len(tokens))[None], torch.zeros(1, dtype=torch.int32),
                            causal_packed_mask(1, len(tokens)), empty, empty)
        return target_probs(out.logits[0, -1], sampling)

    p1 = next_probs(prompt)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1 in range(vocab):
        joint[x1] = p1[x1] * next_probs(prompt + [x1])
    del decoder
    return joint


@pytest.mark.parametrize("method, sampling, proposer", [
    ("clover", SamplingConfig(temperature=1.0), "none"),
    ("clover", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9), "none"),
    ("clover2", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9), "none"),
    # the suffix index is a deterministic proposer: with it the trees change, the distribution must not
    ("clover", SamplingConfig(temperature=1.0), "suffix"),
    ("suffix", SamplingConfig(temperature=0.7, top_k=4, top_p=0.9), "suffix")])
def test_speculative_sampling_matches_target_distribution(method, sampling, proposer):
    target = make_target(seed=3, vocab_size=6)
    with torch.no_grad():  # flatter logits so that rejections and residual sampling both happen
        target.lm_head.weight.mul_(0.3)
    drafter = make_drafter(target, method=method, num_heads=2, seed=4) if method != "suffix" else None
    engine = TorchEngine(target, drafter, draft_top_k=4)
    prompt = [1, 2, 3, 1, 2, 3, 1]  # repeats: the suffix index proposes from the first step on
    expected = _exact_two_token_distribution(target, prompt, sampling).flatten()
    decoder = SpeculativeDecoder(engine, method, TreeConfig(budget=4, top_k=4, prune_ratio=0, proposer=proposer),
                                 max_batch_size=500)
    runs = 3000
    results = decoder.generate([GenerationRequest(prompt, max_new_tokens=2, sampling=sampling, stop_token_ids=(),
                                                  seed=1000 + i) for i in range(runs)])
    counts = np.zeros(36)
    for r in results:
        counts[r.token_ids[0] * 6 + r.token_ids[1]] += 1
    accepted_drafts = sum(r.stats.accepted_per_step[0] for r in results)
    assert 0 < accepted_drafts < runs  # both acceptance and rejection were exercised
    support = expected.numpy() > 1e-9
    assert counts[~support].sum() == 0
    stat, p_value = scipy_stats.chisquare(counts[support], expected.numpy()[support] * runs)
    assert p_value > 0.001, (stat, p_value)
