"""Configuration dataclasses with JSON round-trip.

* :class:`TargetConfig`: a Llama-family target, read from a Hugging Face ``config.json``.
* :class:`DrafterConfig`: Clover / Medusa / ablation heads, saved next to their weights.
* :class:`TreeConfig`: how the token tree is built each step.
* :class:`SamplingConfig`: greedy or sampled verification.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
PROPOSERS = ("suffix", "none")  # model-free tree candidates (TreeConfig.proposer)
DRAFTER_METHODS = ("clover", "clover2", "medusa", "clover-mlp-regressive", "clover-no-regressive", "clover-no-augment")
TOKEN_PATHS = ("residual", "normed", "scaled", "concat")  # DrafterConfig.token_path (issue 28)


class ConfigError(ValueError):
    """A configuration or checkpoint is unsupported or inconsistent."""


def decoding_method(drafter_method: str | None) -> str:
    """The decoding method that runs heads of ``drafter_method``: ``vanilla`` without heads, ``medusa`` for
    Medusa heads, ``clover2`` for Clover-2 (it needs the ``draft_prefill`` callable of engine contract v2),
    ``clover`` for Clover and its ablation variants (they share the regressive draft loop)."""
    if drafter_method is None:
        return "vanilla"
    return drafter_method if drafter_method in ("medusa", "clover2") else "clover"


def drafter_has_draft_prefill(drafter_method: str) -> bool:
    """Whether heads of ``drafter_method`` keep their own KV cache, written by ``draft_prefill`` (engine contract
    v2: Clover-2), before a :class:`DrafterConfig` exists (its mixers take the target's attention head count)."""
    return drafter_method == "clover2"


def read_json_file(path: Path, missing: str) -> Any:
    """Parsed JSON of ``path``; :class:`ConfigError` with ``missing`` when absent, or naming the parse error."""
    if not path.exists():
        raise ConfigError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from exc


class JsonMixin:
    """to_dict / from_dict (unknown fields rejected) / save / load as JSON, for dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path):
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclasses.dataclass
class TargetConfig(JsonMixin):
    """Shape of a Llama-family decoder (Llama, SmolLM, Mistral, Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "TargetConfig":
        """Build from a Hugging Face ``config.json`` dict; reject what this code cannot run.

        Sliding-window attention (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``) equals
        full causal attention on sequences no longer than the window, so the context is capped there
        (``max_position_embeddings``) rather than refused (docs/train-your-own.md#supported-checkpoints).
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={hf.get('architectures')}); Clover supports Llama-family decoders with "
                f"model_type {', '.join(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM, Mistral, Qwen2/2.5)"
            )
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ConfigError(f"quantized checkpoint ({method}); Clover loads fp32/bf16/fp16 safetensors weights")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"unsupported RoPE scaling {rope_type!r}; only the default RoPE is implemented")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported activation {hf.get('hidden_act')!r}; only silu is implemented")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        if model_type == "qwen2":  # Qwen2: bias on q/k/v only
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=_attention_span(hf),
            architecture=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _attention_span(hf: dict[str, Any]) -> int:
    """The longest context on which this code's full causal attention equals the checkpoint's attention."""
    span = hf.get("max_position_embeddings", 2048)
    sliding = hf.get("model_type") == "mistral" or hf.get("use_sliding_window") or \
        "sliding_attention" in (hf.get("layer_types") or [])
    if sliding and hf.get("sliding_window"):
        span = min(span, int(hf["sliding_window"]))
    return span


@dataclasses.dataclass
class DrafterConfig(JsonMixin):
    """Draft heads trained on top of one frozen target.

    ``method`` selects the drafter: ``clover`` (Augmenting Block + Attention
    Decoder + regressive embeddings), ``medusa`` (independent ResBlock heads on
    the normed last hidden state) or an ablation of Clover:
    ``clover-mlp-regressive`` (MLP in place of the Attention Decoder),
    ``clover-no-regressive`` (no token fed back), ``clover-no-augment`` (no
    Augmenting Block); or ``clover2`` (Clover-2: a token-aware Augmenting Block
    of ``block_layers`` decoder layers with its own KV cache, run by
    ``draft_prefill`` after each target pass; docs/drafter.md#clover-2).
    The ``target_*`` fields record which target the heads
    belong to, so loading them on another target fails clearly.
    """

    method: str
    num_heads: int
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    num_attention_heads: int = 1  # Attention Decoder heads
    block_layers: int = 2  # clover2 only: decoder layers of its Augmenting Block
    init_noise_std: float = 0.01
    target_fingerprint: str = ""
    target_architecture: str = "llama"
    # FR-Spec draft vocabulary (docs/drafter.md#draft-vocabulary): the heads score only the first
    # draft_vocab_size ids of draft_vocab.safetensors (most frequent first); 0 scores the full vocabulary
    draft_vocab_size: int = 0
    # How the regressive connection mixes the given token into the state (issue 28; docs/drafter.md#token-path):
    # "residual" (the paper's, and every head saved before the field existed): h + gate * Wv e, e unit-norm, in
    # the raw residual stream; "normed": the same update on the RMS-normalised state with e at RMS 1 (the stream
    # stays normalised); "scaled": "residual" with e times a learned scalar (initialised from the data to the
    # median norm of h0); "concat": EAGLE-style FC([norm(h); e]) with e at RMS 1, no gate
    token_path: str = "residual"
    # Multi-layer features (EAGLE-3; docs/drafter.md#multi-layer-features): the Augmenting Block reads a learned
    # fusion of the inputs of these target layers (0: the embeddings' output, num_layers - 1: the last layer's
    # input) instead of the last layer's input alone. None (every head saved before the field existed): that alone
    feature_layers: list[int] | None = None

    def __post_init__(self) -> None:
        self._check_feature_layers()
        if self.method not in DRAFTER_METHODS:
            raise ConfigError(f"unknown drafter method {self.method!r}; choose one of {', '.join(DRAFTER_METHODS)}")
        if self.num_heads < 1:
            raise ConfigError("a drafter needs at least one head")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} is not in [0, vocab_size {self.vocab_size}]")
        if self.token_path not in TOKEN_PATHS:
            raise ConfigError(f"unknown token path {self.token_path!r}; choose one of {', '.join(TOKEN_PATHS)}")
        if self.token_path != "residual" and self.method not in ("clover", "clover-no-augment"):
            raise ConfigError(f"token path {self.token_path!r} needs the Attention Decoder (method clover or "
                              f"clover-no-augment), not {self.method!r}")

    def _check_feature_layers(self) -> None:
        if self.feature_layers is None:
            return
        layers = list(self.feature_layers)
        if self.method not in ("clover", "clover-mlp-regressive", "clover-no-regressive"):
            raise ConfigError(f"feature_layers feed the Augmenting Block; {self.method!r} heads have none in the "
                              "target pass")
        if len(layers) < 2 or sorted(set(layers)) != layers:
            raise ConfigError(f"feature_layers {layers}: two or more distinct target layers, in increasing order")
        if layers[0] < 0 or layers[-1] >= self.target_num_layers:
            raise ConfigError(f"feature_layers {layers}: layer inputs 0..{self.target_num_layers - 1} only")

    @property
    def has_augmenting_block(self) -> bool:
        """An Augmenting Block inside the target pass (Clover's contract v1; Clover-2's runs in draft_prefill)."""
        return self.method in ("clover", "clover-mlp-regressive", "clover-no-regressive")

    @property
    def has_draft_prefill(self) -> bool:
        """The drafter keeps its own KV cache, written by ``draft_prefill`` (engine contract v2)."""
        return drafter_has_draft_prefill(self.method)

    @property
    def is_medusa(self) -> bool:
        """Medusa heads: no regressive connection, and their output norm is the target's, frozen."""
        return self.method == "medusa"

    @property
    def regressive(self) -> str | None:
        """``attention``, ``mlp`` or None (no regressive connection)."""
        if self.token_path == "concat":
            return "concat"
        return {"clover-mlp-regressive": "mlp", "clover-no-regressive": None, "medusa": None}.get(self.method, "attention")

    @property
    def normalizes_state(self) -> bool:
        """The regressive step RMS-normalises ``h_{i-1}`` before mixing in the token (``normed``, ``concat``)."""
        return self.token_path in ("normed", "concat")

    @property
    def token_embedding_scale(self) -> str:
        """How the token's unit-norm embedding is scaled: ``unit`` (as is), ``rms`` (times sqrt(H): RMS 1, the
        normalised stream's scale) or ``learned`` (times a trained scalar)."""
        return {"residual": "unit", "scaled": "learned"}.get(self.token_path, "rms")


def resolve_feature_layers(spec: str | list[int] | None, num_layers: int) -> list[int] | None:
    """``DrafterConfig.feature_layers`` from a command line: ``eagle3`` (a low, a middle and the highest layer:
    the inputs of layers 2, L/2 and L-1, as EAGLE-3 picks them), comma-separated layer indices, or None/"" (the
    last layer's input alone)."""
    if spec is None or spec == "" or spec == []:
        return None
    if spec == "eagle3":
        return sorted({min(2, num_layers - 1), num_layers // 2, num_layers - 1})
    if isinstance(spec, str):
        try:
            return [int(x) for x in spec.split(",")]
        except ValueError as exc:
            raise ConfigError(f"feature layers {spec!r}: 'eagle3' or comma-separated layer indices") from exc
    return list(spec)


@dataclasses.dataclass
class TreeConfig(JsonMixin):
    """Token-tree settings, passed to the decode loop per call (never stored on modules).

    ``budget``: draft nodes per sequence per step, not counting the root.
    ``depth``: draft depth (<= the drafter's head count); None uses every head.
    ``top_k``: candidates considered per frontier node (at most the engine's draft top-k).
    ``prune_ratio``: drop children whose path probability is below this
    fraction of the level's best.
    ``static_choices``: a fixed Medusa-style tree, as paths of candidate ranks
    (e.g. ``[[0], [1], [0, 0]]``); when given, ``budget`` and pruning are ignored.
    ``adaptive``: choose the budget each step (0 to ``budget``) from the engine's
    cost model and the measured acceptance (:mod:`clover.adaptive`); ``budget``
    is then the largest tree allowed. ``None`` (the default) does so whenever a
    cost model is available and the tree is dynamic, so speculation never costs
    more than it saves (docs/trees.md#adaptive-tree-budget); ``True`` requires a
    cost model; ``False`` keeps the fixed ``budget`` every step.
    ``proposer``: model-free candidates merged into the same tree (docs/trees.md#model-free-candidates):
    ``suffix`` (continuations of the text's longest repeated suffix, :mod:`clover.suffix`) or ``none`` (the
    heads alone). ``None`` (the default) means ``suffix`` for dynamic trees and ``none`` for static ones.
    Both sources share ``budget``. ``proposer_depth``: the deepest model-free candidate (they are not limited
    by the head count). ``shared_suffix_tokens``: also propose from a second index over the outputs of the
    decoder's earlier requests (SuffixDecoding's global tree), keeping at most that many tokens, oldest requests
    evicted first; 0 (the default) turns it off.
    """

    budget: int = 4
    depth: int | None = None
    top_k: int = 8
    prune_ratio: float = 0.02
    static_choices: list[list[int]] | None = None
    adaptive: bool | None = None
    proposer: str | None = None
    proposer_depth: int = 8
    shared_suffix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ConfigError("tree budget must be >= 0")
        if self.proposer not in (None, *PROPOSERS):
            raise ConfigError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        if self.proposer == "suffix" and self.static_choices is not None:
            raise ConfigError("the suffix proposer needs a dynamic tree, not static_choices (use proposer 'none')")
        if self.proposer_depth < 1:
            raise ConfigError(f"proposer_depth must be >= 1, got {self.proposer_depth}")
        if self.shared_suffix_tokens < 0:
            raise ConfigError(f"shared_suffix_tokens (the shared suffix index's cap) must be >= 0, "
                              f"got {self.shared_suffix_tokens}")
        if self.adaptive and self.static_choices is not None:
            raise ConfigError("adaptive speculation needs a dynamic tree, not static_choices")
        if self.top_k < 1:
            raise ConfigError("top_k must be >= 1")
        if self.static_choices is not None:
            paths = {tuple(p) for p in self.static_choices}
            for path in paths:
                if not path or any(c < 0 for c in path):
                    raise ConfigError(f"bad static tree path {list(path)}")
                if len(path) > 1 and path[:-1] not in paths:
                    raise ConfigError(f"static tree path {list(path)} has no parent {list(path[:-1])}")
                if max(path) >= self.top_k:
                    raise ConfigError(f"static tree path {list(path)} needs top_k > {max(path)}")

    @property
    def suffix_candidates(self) -> bool:
        """Whether model-free suffix candidates join the tree (``proposer`` resolved)."""
        return self.proposer == "suffix" or (self.proposer is None and self.static_choices is None)


# the torch backend's weights on a checkpoint (clover.backends.load_checkpoint_engine): auto is bf16 on a GPU, fp32 on
# a CPU; fp32 is token-exact with the reference (docs/gpu-engine.md#precision)
CHECKPOINT_DTYPES = ("auto", "fp32", "bf16")

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
# The sampling ranges of every interface: clover generate, clover client, the Triton model and the OpenAI endpoint
# (OpenAI's temperature range; top_k and seed: what the model's INT32 and UINT64 inputs hold). top_p: (0, 1].
SAMPLING_RANGES = {"temperature": (0, 2), "top_k": (0, INT32_MAX), "seed": (0, UINT64_MAX)}


def sampling_range_error(name: str, value: float) -> str | None:
    """What is wrong with sampling parameter ``name`` = ``value`` (NaN included), or None when it is in range."""
    finite = "" if value == value else ", a finite number"  # NaN is the one value not equal to itself
    if name == "top_p":
        return None if 0 < value <= 1 else f"top_p must be in (0, 1]{finite}"
    low, high = SAMPLING_RANGES[name]
    return None if low <= value <= high else f"{name} must be between {low} and {high}{finite}"


def new_tokens_range(context: int) -> tuple[int, int]:
    """The new tokens a server request may ask for (the Triton model's max_tokens, the OpenAI endpoint's): at
    least 1, at most the engine's ``context`` (no answer is longer). The library takes any count >= 1."""
    return 1, context


@dataclasses.dataclass
class SamplingConfig(JsonMixin):
    """Per-sequence sampling. ``temperature == 0`` is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k"):
            problem = sampling_range_error(name, getattr(self, name))
            if problem:
                raise ConfigError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
