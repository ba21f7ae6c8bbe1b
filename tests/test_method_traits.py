"""The decoding methods' traits (clover/methods.py): what call sites ask instead of comparing names (issue 46)."""

from __future__ import annotations

import pytest

from clover.config import DRAFTER_METHODS, ConfigError, DrafterConfig, decoding_method, drafter_has_draft_prefill
from clover.methods import (AUTO, DEFAULT_METHOD, HEAD_METHODS, METHOD_CHOICES, METHODS, method_traits,
                            resolve_method, uses_heads)

# each method's traits as the call sites read them before they asked (cli.py, decode.py, served_engine.py,
# backends/torch.py): (drafts, uses heads, suffix alone, own draft cache, device stepper)
EXPECTED = {"vanilla": (False, False, False, False, True), "medusa": (True, True, False, False, True),
            "clover": (True, True, False, False, True), "clover2": (True, True, False, True, False),
            "suffix": (True, False, True, False, False)}


def test_the_traits_of_each_method():
    assert METHODS == ("vanilla", "medusa", "clover", "clover2", "suffix")
    assert HEAD_METHODS == ("medusa", "clover", "clover2") and METHOD_CHOICES == (AUTO, *METHODS)
    for name in METHODS:
        t = method_traits(name)
        assert t.name == name and uses_heads(name) == t.uses_heads
        assert (t.drafts, t.uses_heads, t.needs_suffix, t.owns_draft_cache, t.runs_on_device_stepper) == EXPECTED[name]
    with pytest.raises(ConfigError, match="unknown method 'auto'"):
        method_traits(AUTO)


def test_a_method_runs_on_heads_of_its_own_family_or_needs_none():
    for name in METHODS:
        for heads in (None, *HEAD_METHODS):
            assert method_traits(name).runs_on_heads_of(heads) == (name in ("vanilla", "suffix") or name == heads)


def test_resolve_method():
    assert resolve_method(AUTO, "clover2") == "clover2" and resolve_method(AUTO, DEFAULT_METHOD) == "clover"
    assert resolve_method("suffix", "clover") == "suffix"
    with pytest.raises(ConfigError, match="unknown method"):
        resolve_method("beam", "clover")


def test_drafter_architectures_map_to_methods_and_capabilities():
    for arch in DRAFTER_METHODS:
        assert decoding_method(arch) in HEAD_METHODS
        assert drafter_has_draft_prefill(arch) == (arch == "clover2")
        assert method_traits(decoding_method(arch)).owns_draft_cache == drafter_has_draft_prefill(arch)
    config = DrafterConfig(method="medusa", num_heads=2, hidden_size=8, vocab_size=16, target_num_layers=2,
                           num_attention_heads=2)
    assert config.is_medusa and not config.has_draft_prefill
