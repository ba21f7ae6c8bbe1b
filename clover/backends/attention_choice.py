"""Which attention a device pass runs: SDPA with a mask, or the project's TreeAttention kernel
(docs/gpu-engine.md#attention).

Neither wins everywhere: the kernel reads each row's cache only up to its length and needs no mask, but at some
shapes (B 16 × T 16 × past 4,096 on an H200) it is 4× slower than SDPA. ``auto`` times both on each decode-step
shape the first time it is seen (at load, where the CUDA graphs are captured) and keeps the faster.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from clover.attention import InPlaceAttention
from clover.config import ConfigError
from clover.timing import median_seconds_of

logger = logging.getLogger(__name__)

ATTENTION_MODES = ("auto", "sdpa", "kernel")
TIMED_MAX_TOKENS = 128  # passes with more tokens in flight (prompts) take SDPA under auto: too many widths to time

# (q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale) -> out: clover.attention.tree_attention's signature
KernelFn = Callable[..., torch.Tensor]


def load_kernel(mode: str, device: torch.device) -> KernelFn | None:
    """The TreeAttention kernel's torch op for ``mode``, or None. ``kernel`` requires it (a clear error where it
    cannot be); ``auto`` uses it where it builds, and says once why not; ``sdpa`` never."""
    if mode not in ATTENTION_MODES:
        raise ConfigError(f"attention {mode!r}: choose {', '.join(ATTENTION_MODES)}")
    if mode == "sdpa" or (mode == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise ConfigError("attention=kernel needs a CUDA device (the kernel is CUDA code); use sdpa or auto")
    try:
        from clover.kernels.tree_attention import load_extension  # import-guarded: builds with nvcc on first use

        extension = load_extension()
    except Exception as exc:  # auto falls back; kernel was asked for by name
        if mode == "kernel":
            raise ConfigError(f"attention=kernel: the TreeAttention kernel did not build ({exc})") from exc
        logger.warning("attention: SDPA only, the TreeAttention kernel did not build (%s)", exc)
        return None

    def kernel(q, k, v, k_cache, v_cache, past_lengths, packed_mask, scale=None):
        return extension.tree_attention(q, k, v, k_cache, v_cache, past_lengths, packed_mask,
                                        0.0 if scale is None else scale)
    return kernel


class AttentionChoice:
    """Per pass shape (rows, tokens in flight, attended positions), the kernel to attend with, or None for SDPA.

    ``mode`` ``kernel``: always the kernel; ``sdpa`` (or no kernel): never; ``auto``: whichever of the two ran
    one attention call of that shape faster (``timer``: median seconds of ``repeats``), measured at the first
    pass of the shape, with every row's cache filled to the attended length (the bucket's worst case), on
    random inputs of the target's head layout. ``timings`` keeps what was measured, for the log and reports.
    """

    def __init__(self, mode: str, kernel: KernelFn | None, heads: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, timer=median_seconds_of, repeats: int = 20) -> None:
        self.mode, self.kernel = mode, kernel
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.dtype, self.device = dtype, device
        self.timer, self.repeats = timer, repeats
        self.timings: dict[tuple[int, int, int], tuple[float, float]] = {}  # shape -> (sdpa s, kernel s)

    def kernel_for(self, batch: int, tokens: int, kv_len: int) -> KernelFn | None:
        if self.kernel is None or self.mode == "sdpa":
            return None
        if self.mode == "kernel":
            return self.kernel
        if tokens > TIMED_MAX_TOKENS:
            return None
        shape = (batch, tokens, kv_len)
        if shape not in self.timings:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None  # cannot time inside a capture; the warm-up before it decides the shape
            self.timings[shape] = self._measure(batch, tokens, kv_len)
            sdpa, kernel = self.timings[shape]
            logger.info("attention for B %d × T %d × %d positions: %s (SDPA %.3f ms, kernel %.3f ms)", batch,
                        tokens, kv_len, "kernel" if kernel < sdpa else "SDPA", sdpa * 1e3, kernel * 1e3)
        sdpa, kernel = self.timings[shape]
        return self.kernel if kernel < sdpa else None

    def _measure(self, batch: int, tokens: int, kv_len: int) -> tuple[float, float]:
        """(SDPA seconds, kernel seconds) of one attention call of this shape; nothing is written anywhere."""
        def tensor(*shape):
            return torch.randn(*shape, dtype=self.dtype, device=self.device)

        q = tensor(batch, tokens, self.num_heads, self.head_dim)
        k, v = tensor(batch, tokens, self.num_kv_heads, self.head_dim), tensor(batch, tokens, self.num_kv_heads,
                                                                               self.head_dim)
        caches = [tensor(batch, self.num_kv_heads, kv_len, self.head_dim) for _ in range(2)]
        past = torch.full((batch,), max(0, kv_len - tokens), dtype=torch.int64, device=self.device)
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.device).tril().expand(batch, -1, -1)
        by_sdpa, by_kernel = InPlaceAttention(past, causal, kv_len), InPlaceAttention(past, causal, kv_len)
        by_kernel.use_kernel(self.kernel)
        return tuple(self.timer(lambda a=attention: a.read(q, k, v, *caches), self.repeats, self.device)
                     for attention in (by_sdpa, by_kernel))
