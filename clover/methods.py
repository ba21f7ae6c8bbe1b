"""The decoding methods by name, and what each does (:class:`MethodTraits`): the one place that says so.

Other modules ask :func:`method_traits`, never compare names (tests/test_code_health.py checks);
:func:`clover.proposers.make_proposer` maps a name to its proposer. This module imports no torch, so the command
line builds its ``--method`` choices (and answers ``--help``) without loading it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from clover.config import ConfigError, TreeConfig

if TYPE_CHECKING:  # for the annotations alone: clover.engine_contract imports torch
    from clover.engine_contract import EngineSpec


@dataclasses.dataclass(frozen=True)
class MethodTraits:
    """What a decoding method does, for the call sites that must know: they ask these, never compare names
    (tests/test_code_health.py checks), so a new method is one entry of :data:`METHOD_TRAITS`."""

    name: str
    drafts: bool = True  # its steps verify draft tokens (vanilla: the next token alone)
    uses_heads: bool = False  # it drafts with the engine's trained heads (it loads some, of its own family)
    needs_suffix: bool = False  # it drafts with the suffix proposer alone (a dynamic tree, proposer suffix)
    owns_draft_cache: bool = False  # its heads draft from the drafter's own KV cache (Clover-2, contract v2)

    @property
    def runs_on_device_stepper(self) -> bool:
        """A device stepper can run its steps (docs/gpu-engine.md): the heads' dynamic trees or vanilla; not the
        suffix proposer alone, nor clover2's second cache (static trees are the tree's matter, not the method's)."""
        return not self.needs_suffix and not self.owns_draft_cache

    def runs_on_heads_of(self, heads_method: str | None) -> bool:
        """Whether an engine whose heads decode as ``heads_method`` (:attr:`EngineSpec.default_method
        <clover.engine_contract.EngineSpec.default_method>`; None: no heads) runs this method: one without heads
        runs anywhere, one with heads only on heads of its own family."""
        return not self.uses_heads or self.name == heads_method


METHOD_TRAITS = {traits.name: traits for traits in (
    MethodTraits("vanilla", drafts=False),
    MethodTraits("medusa", uses_heads=True),
    MethodTraits("clover", uses_heads=True),
    MethodTraits("clover2", uses_heads=True, owns_draft_cache=True),
    MethodTraits("suffix", needs_suffix=True),
)}
METHODS = tuple(METHOD_TRAITS)  # ("vanilla", "medusa", "clover", "clover2", "suffix")
HEAD_METHODS = tuple(name for name, traits in METHOD_TRAITS.items() if traits.uses_heads)
AUTO = "auto"  # where a method is chosen: the engine's own heads' family (EngineSpec.default_method)
METHOD_CHOICES = (AUTO, *METHODS)  # what ``clover serve`` and the served model's parameters accept
DEFAULT_METHOD = "clover"  # the torch path's, where no engine says: the demo's shipped Clover heads


def method_traits(method: str) -> MethodTraits:
    """``method``'s :class:`MethodTraits`; ConfigError for a name no proposer implements."""
    check_method(method)
    return METHOD_TRAITS[method]


def resolve_method(method: str, default: str) -> str:
    """``method``, or ``default`` (the engine's :attr:`~clover.engine_contract.EngineSpec.default_method`, or
    :data:`DEFAULT_METHOD` before an engine is loaded) for ``auto``; ConfigError for an unknown name."""
    method = default if method == AUTO else method
    check_method(method)
    return method


def uses_heads(method: str) -> bool:
    """Whether ``method`` drafts with the engine's heads (``suffix`` and ``vanilla`` do not)."""
    return method in HEAD_METHODS


def check_method(method: str, tree: TreeConfig | None = None, spec: EngineSpec | None = None) -> None:
    """ConfigError for a method name no proposer implements, or (given ``tree`` and the engine's ``spec``) one
    that cannot draft with those: heads the engine lacks or of another family, a suffix proposer turned off, a
    static tree of ranks beyond the engine's draft top-k."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if spec is not None and uses_heads(method):
        if not spec.num_draft_heads:
            raise ConfigError(f"method {method!r} needs draft heads; pass a drafter or use --method vanilla")
        if not METHOD_TRAITS[method].runs_on_heads_of(spec.default_method):
            raise ConfigError(f"method {method!r} does not match the engine's {spec.drafter_method!r} drafter")
    if tree is not None and METHOD_TRAITS[method].needs_suffix and not tree.suffix_candidates:
        raise ConfigError("method 'suffix' drafts with the suffix proposer: it needs a dynamic tree and "
                          f"proposer 'suffix' (got proposer={tree.proposer!r}"
                          f"{', a static tree' if tree.static_choices is not None else ''})")
    if tree is not None and spec is not None and tree.static_choices is not None and uses_heads(method):
        deepest_rank = max(max(p) for p in tree.static_choices)
        if deepest_rank >= spec.draft_top_k:
            raise ConfigError(f"static tree needs rank {deepest_rank}, the engine's draft top-k is {spec.draft_top_k}")


def suffix_candidates_on(method: str, tree: TreeConfig) -> bool:
    """Whether ``method``'s trees take suffix candidates: every drafting method with ``tree``'s suffix proposer
    and a tree budget to fill (docs/trees.md#model-free-candidates)."""
    return METHOD_TRAITS[method].drafts and tree.suffix_candidates and tree.budget > 0


def tree_nodes(tree: TreeConfig) -> int:
    """Draft nodes a drafting proposer's tree holds at most: the static tree's, else the budget."""
    return len(tree.static_choices) if tree.static_choices is not None else tree.budget
