"""The device engine: the torch backend with the whole decode step on the device, replayed from CUDA graphs
(docs/gpu-engine.md).

:class:`DeviceEngine` is a :class:`~clover.backends.torch.TorchEngine` whose target writes its K/V into the static
cache in place (engine contract v3) and whose decode step runs as :func:`clover.device_step.decode_step`: draft
loop, tree, target pass, acceptance, KV commit and the next roots all stay on the device, and the host reads back
one ``[B, A + 3]`` int64 tensor per step. On a GPU each step shape (batch bucket × budget × attended cache
positions) is captured once as a CUDA graph and replayed; other shapes run eagerly, said once in the log. On a CPU
the same step runs eagerly: that is what the token-exactness tests run here.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import os
import time

import numpy as np
import torch

from clover.adaptive import CostModel, SourceCalibration, monotone_fit
from clover.attention import InPlaceAttention, unpack_mask
from clover.backends.attention_choice import AttentionChoice, load_kernel
from clover.backends.torch import TorchEngine
from clover.config import TreeConfig
from clover.demo import cache_root
from clover.device_step import (PADDING_SCORE, DeviceCalibration, DeviceSampling, GivenCandidates, StepShape,
                                decode_step, sample_rows)
from clover.engine_contract import DraftResult, TargetResult
from clover.kv_cache import KVCache
from clover.timing import median_seconds_of

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BUDGET_BUCKETS = (4, 8, 16, 32, 64)  # heads' budgets with graphs of their own, besides 0 and the configured one
KV_BLOCK = 256  # attended cache positions are rounded up to a power-of-two multiple of this
GPU_TREE_BUDGET = 32
CAPTURE_AHEAD_POSITIONS = 1024  # graphs for steps attending to up to this many positions are captured at load


def bucket_at_least(buckets, value: int) -> int | None:
    """The smallest bucket >= ``value``; None past the last."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


def kv_bucket(needed: int, max_seq_len: int) -> int:
    """Cache positions a step attends to: ``needed`` rounded up to ``KV_BLOCK`` times a power of two, at most the
    cache. Few shapes (so few graphs), and attention reads about the filled part only."""
    size = KV_BLOCK
    while size < needed:
        size *= 2
    return min(size, max_seq_len)


def compile_decoder_layers(target_step) -> None:
    """torch.compile each decoder layer (the Augmenting Block's too), shape-generic (``dynamic=True``), so one
    compilation serves every step shape; compiled kernels are cached on disk between runs
    (``$TORCHINDUCTOR_CACHE_DIR``, default ``inductor`` in the user cache: ``$CLOVER_CACHE_DIR``, else
    ``~/.cache/clover``). The compile happens at each layer's first
    call: the first steps (or the graph captures) take it (docs/gpu-engine.md#cuda-graphs)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    layers = list(target_step.target.layers) + ([target_step.augment] if target_step.augment is not None else [])
    for layer in layers:
        layer.compile(dynamic=True)


class DeviceEngine(TorchEngine):
    """A torch engine whose decode step runs on the device (:meth:`device_stepper`).

    ``cuda_graphs``: capture steps as CUDA graphs (on a CUDA device only; default there). ``attention``: ``auto``
    (default: per step shape the faster of SDPA and the kernel, timed at load; SDPA on a CPU), ``sdpa``, or
    ``kernel``: the project's TreeAttention CUDA kernel as a torch op (built with nvcc on first use:
    ``clover/kernels/``; docs/gpu-engine.md#attention).
    """

    writes_cache_in_place = True

    def __init__(self, *args, cuda_graphs: bool | None = None, attention: str = "auto", compile_layers: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; this engine is on " + str(self.device))
        config = self.target_step.target.config
        self.attention = AttentionChoice(attention, load_kernel(attention, self.device),
                                         (config.num_heads, config.num_kv_heads, config.head_dim), self.spec.dtype,
                                         self.device)
        if compile_layers:
            compile_decoder_layers(self.target_step)

    @property
    def tree_defaults(self) -> TreeConfig:
        """The tree a server runs on this engine by default: on a GPU a tree of 32 draft nodes, which the adaptive
        budget shrinks where it does not pay (a tree costs little more than one token there: docs/gpu-engine.md);
        on a CPU the torch engine's default."""
        return TreeConfig(budget=GPU_TREE_BUDGET) if self.cuda_graphs else TreeConfig()

    # -- the contract's callables, for the prefill and for steps the host runs ------------------------------

    @torch.inference_mode()
    def target(self, input_ids, position_ids, past_lengths, packed_mask, k_cache, v_cache) -> TargetResult:
        """Contract v3: the new tokens' K/V go into the cache at ``[past, past + T)``; no presents come back."""
        num_tokens = input_ids.shape[1]
        kv_len = min(int(past_lengths.max()) + num_tokens, k_cache[0].shape[2])
        past, ids, positions, mask = self._to_device(past_lengths, input_ids, position_ids, packed_mask)
        attention = InPlaceAttention(past, unpack_mask(mask, num_tokens), kv_len)
        logits, h0 = self.device_target(ids, positions, attention, k_cache, v_cache)
        return TargetResult(logits.float().cpu(), h0.cpu(), None, None)

    # -- the step on the device -------------------------------------------------------------------------------

    def device_target(self, input_ids, position_ids, attention: InPlaceAttention, k_cache, v_cache):
        """(logits, h0) of one pass on device tensors, writing the cache in place."""
        kernel = self.attention.kernel_for(input_ids.shape[0], input_ids.shape[1], attention.kv_len)
        if kernel is not None:
            attention.use_kernel(kernel)
        out = self.target_step(input_ids, position_ids, attention.write_index[:, 0], attention, k_cache, v_cache)
        return out.logits, out.h0

    def device_draft(self, hidden, token, head: int) -> DraftResult:
        return self.draft(hidden, token, head)

    def device_stepper(self, cache: KVCache, max_batch_size: int, max_budget: int = 0,
                       max_depth: int | None = None) -> "DeviceStepper":
        return DeviceStepper(self, cache, max_batch_size, max_budget, max_depth)


class DeviceStepper:
    """Runs decode steps of a :class:`~clover.decode.SpeculativeDecoder`'s live rows on the device.

    Owns what the step keeps on the device besides the cache: each row's root state (h0 at its last accepted
    position), the candidate sources' calibration (:class:`~clover.device_step.DeviceCalibration`, from the
    priors of a :class:`~clover.adaptive.SourceCalibration` of ``max_depth`` levels, default the heads'; deeper
    candidates use its last depth), and the step's input and output buffers, which CUDA graphs read and write.
    """

    def __init__(self, engine: DeviceEngine, cache: KVCache, max_batch_size: int, max_budget: int = 0,
                 max_depth: int | None = None) -> None:
        self.engine = engine
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch_size) + (max_batch_size,)
        self.budgets = tuple(sorted({0, max_budget, *(b for b in BUDGET_BUCKETS if b < max_budget)}))
        cache.reserve(self.buckets[-1])
        self.cache = cache
        device, spec = engine.device, engine.spec
        self.root_hidden = torch.zeros(cache.capacity, spec.hidden_size, dtype=spec.dtype, device=device)
        self.root_tokens = torch.zeros(cache.capacity, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(cache.capacity, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._host_inputs = torch.zeros(2, cache.capacity, dtype=torch.int64, pin_memory=pinned)
        self._graphs: dict[tuple, tuple] = {}  # (shape, cache storage) -> (graph, output)
        self._pool = torch.cuda.graph_pool_handle() if engine.cuda_graphs else None  # one pool: graphs run in turn
        self._given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # candidates per row -> device buffers
        depth = engine.spec.num_draft_heads if max_depth is None else max_depth
        self.calibration = DeviceCalibration.of(SourceCalibration(max(depth, 1)), device)
        # per row: temperature, top-k, top-p; the seed's halves and tokens generated (device_step.sampling_arrays)
        self._settings = torch.zeros(3, cache.capacity, device=device)
        self._seeds = torch.zeros(3, cache.capacity, dtype=torch.int64, device=device)
        self.capture_seconds = 0.0

    @property
    def graphs(self) -> list:
        """The CUDA graphs captured so far, one per step shape."""
        return [graph for graph, _ in self._graphs.values()]

    def load_root(self, row: int, hidden: torch.Tensor) -> None:
        """A row's root state after its prefill (the host has it then)."""
        self.root_hidden[row].copy_(hidden, non_blocking=True)

    def calibration_factors(self) -> np.ndarray:
        """The device calibration's factors ``[1 + SUFFIX_MATCH_ROWS, D + 1]`` on the host (a read: not in a step)."""
        return (self.calibration.accepted / self.calibration.predicted).cpu().numpy()

    def root_of(self, row: int) -> torch.Tensor:
        """A row's root state on the host, for a step the host runs."""
        return self.root_hidden[row].cpu()

    def reorder(self, order: list[int]) -> None:
        """The cache compacted its rows (``order[j]``: the old row now at j): the root states follow."""
        if order != list(range(len(order))):
            index = torch.tensor(order, device=self.root_hidden.device)
            self.root_hidden[: len(order)] = self.root_hidden.index_select(0, index)

    def shape(self, num_rows: int, budget: int, depth: int, top_k: int, given: int = 0,
              given_depth: int = 0, sampling: bool = False) -> StepShape | None:
        """The step shape for ``num_rows`` live rows, or None when no batch bucket holds them. The budget is
        rounded down to one of :attr:`budgets`, so a few graphs serve every budget the chooser picks. ``given``,
        ``given_depth``: suffix candidates per row (padded) and their deepest level, 0 for none; ``sampling``: some
        row samples."""
        batch = bucket_at_least(self.buckets, num_rows)
        if batch is None:
            return None
        budget = max(b for b in self.budgets if b <= budget) if depth or given else 0
        lengths = self.cache.lengths_array
        needed = (int(lengths.max()) if len(lengths) else 0) + (1 + budget if budget else 1)
        return StepShape(batch, budget, depth if budget else 0, top_k, top_k, kv_bucket(needed, self.cache.max_seq_len),
                         given if budget else 0, given_depth if budget and given else 0, sampling)

    @torch.inference_mode()
    def capture_ahead(self, depth: int, top_k: int, given: int = 0, given_depth: int = 0,
                      max_positions: int = CAPTURE_AHEAD_POSITIONS) -> None:
        """Capture the graphs of every batch bucket × budget × attended positions up to ``max_positions`` now (at
        load), so that serving does not pause to capture; longer contexts are captured when first reached."""
        if not self.engine.cuda_graphs or self.cache.num_rows:
            return
        positions = sorted({kv_bucket(n, self.cache.max_seq_len) for n in range(1, max_positions + 1, KV_BLOCK)})
        for batch in self.buckets:
            for budget in self.budgets:
                for kv_len, with_given in itertools.product(positions, sorted({0, given})):
                    shape = StepShape(batch, budget, depth if budget else 0, top_k, top_k, kv_len,
                                      with_given if budget else 0, given_depth if budget and with_given else 0)
                    if self._key(shape) not in self._graphs:
                        self._graphs[self._key(shape)] = self._capture(shape)
        logger.info("captured %d CUDA graphs in %.1f s", len(self._graphs), self.capture_seconds)

    @torch.inference_mode()
    def prefill(self, rows: slice, input_ids: torch.Tensor, lengths: torch.Tensor,
                sampling: tuple[np.ndarray, np.ndarray] | None) -> list[int]:
        """The causal pass over new prompts in cache ``rows`` (right-padded ``input_ids [n, W]``, ``lengths [n]``),
        on the device: their K/V and root states stay there, and only each first token comes back.

        sampling: :func:`clover.device_step.sampling_arrays` of the rows (None: greedy).
        """
        device, (batch, width) = self.root_hidden.device, input_ids.shape
        keys, values = self.cache.buffers
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(batch, -1, -1)
        attention = InPlaceAttention(torch.zeros(batch, dtype=torch.int64, device=device), causal, width)
        positions = torch.arange(width, device=device).expand(batch, -1)
        logits, h0 = self.engine.device_target(input_ids.to(device), positions, attention,
                                               [keys[i, rows] for i in range(keys.shape[0])],
                                               [values[i, rows] for i in range(values.shape[0])])
        index = torch.arange(batch, device=device), (lengths - 1).to(device)
        self.root_hidden[rows] = h0[index]
        if sampling is None:
            return logits[index].argmax(-1).tolist()
        self._upload_sampling(sampling)
        return sample_rows(logits[index], self._device_sampling(batch)).tolist()

    @torch.inference_mode()
    def calibrate(self, depth: int, top_k: int, repeats: int = 5) -> CostModel:
        """A cost model of whole steps (docs/gpu-engine.md#adaptive-budget): each batch bucket × budget timed as
        it runs (graph replays on a GPU; the median of ``repeats``), at the shortest attended length. Steps of one
        row or without a tree price ``target`` by the step's tokens in flight; trees of several rows
        ``target_batched``; the draft steps are inside every step's time, so ``draft`` stays empty."""
        saved_roots = self.root_hidden.clone()
        curves: dict[str, list] = {"target": [], "target_batched": []}
        for batch in self.buckets:
            for budget in self.budgets:
                shape = StepShape(batch, budget, depth if budget else 0, top_k, top_k, min(KV_BLOCK,
                                  self.cache.max_seq_len))
                seconds = median_seconds_of(lambda: self._run(shape), repeats, self.root_hidden.device)
                curve = "target" if batch == 1 or shape.tree_tokens == 1 else "target_batched"
                curves[curve].append([batch * shape.tree_tokens, seconds])
        self.root_hidden.copy_(saved_roots)
        where = torch.cuda.get_device_name() if self.engine.cuda_graphs else "cpu"
        return CostModel(monotone_fit(sorted(curves["target"])), [], source=f"device engine steps on {where}, measured at load",
                         target_batched=monotone_fit(sorted(curves["target_batched"])))

    @torch.inference_mode()
    def step(self, shape: StepShape, root_tokens: list[int], given: np.ndarray | None = None,
             sampling: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """One decode step of the live rows; returns :func:`clover.device_step.emit`'s rows for them.

        given: :func:`clover.device_step.given_arrays` of the rows' suffix proposals, when ``shape.given``;
        sampling: :func:`clover.device_step.sampling_arrays` of the rows, when ``shape.sampling``.
        """
        rows = len(root_tokens)
        host = self._host_inputs
        host.zero_()
        host[0, :rows] = torch.from_numpy(self.cache.lengths_array.astype(np.int64))
        host[1, :rows] = torch.tensor(root_tokens, dtype=torch.int64)
        self.lengths.copy_(host[0], non_blocking=True)
        self.root_tokens.copy_(host[1], non_blocking=True)
        if shape.given:
            self._upload_given(shape.given, given)
        if shape.sampling:
            self._upload_sampling(sampling)
        output = self._run(shape)
        return output[:rows].cpu().numpy()  # the step's one device-to-host copy

    def _upload_sampling(self, sampling: tuple[np.ndarray, np.ndarray]) -> None:
        floats, ints = sampling
        rows = floats.shape[1]
        self._settings.zero_()  # padding rows: greedy
        self._settings[:, :rows].copy_(torch.from_numpy(floats), non_blocking=True)
        self._seeds[:, :rows].copy_(torch.from_numpy(ints), non_blocking=True)

    def _device_sampling(self, batch: int) -> DeviceSampling:
        settings, seeds = self._settings[:, :batch], self._seeds[:, :batch]
        return DeviceSampling(settings[0], settings[1].to(torch.int64), settings[2], seeds[0], seeds[1], seeds[2])

    def _given_buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device buffers of ``width`` given candidates per row: int64 ``[4, capacity, width]`` (tokens,
        parents, depths, keys) and float32 ``[capacity, width]`` (scores); padding where no row wrote."""
        if width not in self._given:
            device = self.root_tokens.device
            ids = torch.zeros(4, self.cache.capacity, width, dtype=torch.int64, device=device)
            ids[1], ids[3] = -1, 1
            scores = torch.full((self.cache.capacity, width), PADDING_SCORE, device=device)
            self._given[width] = (ids, scores)
        return self._given[width]

    def _upload_given(self, width: int, given: np.ndarray) -> None:
        ids, scores = self._given_buffers(width)
        rows = given.shape[1]
        ids[:, :rows].copy_(torch.from_numpy(given[[0, 1, 2, 4]].astype(np.int64)), non_blocking=True)
        scores[:rows].copy_(torch.from_numpy(given[3].astype(np.float32)), non_blocking=True)
        ids[:, rows:] = 0  # padding rows: no candidates
        ids[1, rows:], ids[3, rows:] = -1, 1
        scores[rows:] = PADDING_SCORE

    def _run(self, shape: StepShape) -> torch.Tensor:
        if not self.engine.cuda_graphs:
            return self._eager(shape)
        key = self._key(shape)
        if key not in self._graphs:
            logger.info("capturing a CUDA graph for a step shape not captured at load: %s", shape)
            self._graphs[key] = self._capture(shape)
        graph, output = self._graphs[key]
        graph.replay()
        return output

    def _key(self, shape: StepShape) -> tuple:
        return dataclasses.astuple(shape) + (self.cache.buffers[0].data_ptr(),)

    def _eager(self, shape: StepShape) -> torch.Tensor:
        keys, values = self.cache.buffers
        batch = shape.batch
        engine = self.engine

        def target(input_ids, position_ids, attention):
            layers = keys.shape[0]
            return engine.device_target(input_ids, position_ids, attention,
                                        [keys[i, :batch] for i in range(layers)],
                                        [values[i, :batch] for i in range(layers)])

        draft = engine.device_draft if engine.draft is not None else None
        given = None
        if shape.given:
            ids, scores = self._given_buffers(shape.given)
            given = GivenCandidates(ids[0, :batch], ids[1, :batch], ids[2, :batch], scores[:batch], ids[3, :batch, 0])
        sampling = self._device_sampling(batch) if shape.sampling else None
        return decode_step(target, draft, keys[:, :batch], values[:, :batch], self.lengths[:batch],
                           self.root_tokens[:batch], self.root_hidden[:batch], shape, given, sampling,
                           self.calibration)

    def _capture(self, shape: StepShape):
        """A CUDA graph of the step (torch.cuda.graphs: warm up on a side stream, then capture). The warm-up
        runs are real steps on the live inputs: they write K/V only past each row's length, which no later step
        reads before writing, and the root states and the calibration, which are restored after them."""
        started = time.perf_counter()
        if shape.given:  # made outside the capture: a graph must not replay their initial values
            self._given_buffers(shape.given)
        saved_roots = self.root_hidden.clone()
        saved_calibration = self.calibration.predicted.clone(), self.calibration.accepted.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager(shape)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._eager(shape)
        self.root_hidden.copy_(saved_roots)
        self.calibration.predicted.copy_(saved_calibration[0])
        self.calibration.accepted.copy_(saved_calibration[1])
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - started
        logger.debug("captured a CUDA graph for %s in %.2f s", shape, time.perf_counter() - started)
        return graph, output
