"""Ranks of a tensor-parallel target in lock step (docs/serving.md#tensor-parallel).

Every rank runs the same :class:`~clover.decode.SpeculativeDecoder` step on its slice of the target
(:mod:`clover.tensor_parallel`). Rank 0 owns the requests: before each step it broadcasts what changed (new
requests, cancellations), and the other ranks apply it and run the same step. Every rank then computes the
same trees and acceptances: the logits are all-gathered, so they are bit for bit the same everywhere, and the
one source of difference, the adaptive chooser's own step timing, is off (rank 0's cost model is broadcast).

Rendezvous is torchrun's: ``MASTER_ADDR``/``MASTER_PORT`` over TCP, ``--nnodes``/``--node-rank`` for several
hosts; ``python -m clover.lockstep`` runs the ranks other than 0 (:func:`main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

from clover.config import ConfigError, TreeConfig
from clover.decode import GenerationRequest, SpeculativeDecoder
from clover.rendezvous import Rendezvous, add_rendezvous_options, rendezvous_of, start_followers, stop_followers
from clover.tensor_parallel import Shard

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # an engine collective that waits longer fails: a rank hung (docs/serving.md#faults)
# the ranks' meeting may wait for tritonserver to start rank 0 (minutes on a busy machine): clover serve's
# --startup-timeout default
RENDEZVOUS_TIMEOUT_S = 600.0
_IDLE_TIMEOUT = datetime.timedelta(days=365)  # a server may sit idle: followers wait for rank 0's next step
_STOP = "stop"


@dataclasses.dataclass(frozen=True)
class EngineRecipe:
    """How every rank loads the same torch engine (:meth:`clover.backends.torch.TorchEngine.from_checkpoint`)."""

    target: str = "demo"
    drafter: str | None = None
    method: str = "clover"
    max_seq_len: int = 2048
    cache_dir: str | None = None
    dtype: str = "fp32"
    threads: int | None = None  # None: this host's cores over its ranks
    calibrate_tokens: int | None = None  # time the steps for the adaptive budget (all ranks together)


def join(rendezvous: Rendezvous, rank: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Shard:
    """Meet the other ranks (waiting up to :data:`RENDEZVOUS_TIMEOUT_S`); returns this rank's :class:`Shard`,
    whose group (gloo on CPUs, nccl where CUDA is) times collectives out after ``timeout_s``. The step plans
    travel on a gloo group of their own with no timeout: a server may be idle."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % rendezvous.ranks_per_node)
    dist.init_process_group("gloo", init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
                            rank=rank, world_size=rendezvous.world_size,
                            timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    global _control, _ranks_here
    _control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    _ranks_here = rendezvous.ranks_per_node
    engine_group = dist.new_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Shard(rank, rendezvous.world_size, engine_group)


_control = None  # the gloo group of the step plans, set by join()
_ranks_here = 1  # ranks on this host, set by join()


def _broadcast(value=None):
    """Rank 0's ``value`` on every rank (the control group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def leave(tell_followers: bool = True) -> None:
    """Leave the process group; rank 0 first tells the followers to stop (:meth:`LockstepDecoder.follow`)."""
    if not dist.is_initialized():
        return
    if dist.get_rank() == 0 and tell_followers:
        try:
            _broadcast(_STOP)
        except RuntimeError:  # a follower is gone already: the launcher stops the rest
            log.warning("could not tell every rank to stop")
    dist.destroy_process_group()


def load_engine(recipe: EngineRecipe | None, shard: Shard):
    """(engine, tokenizer) of this rank: rank 0 passes its recipe, which the others receive."""
    from clover.backends.torch import TorchEngine
    from clover.target import load_tokenizer

    recipe = _broadcast(recipe)
    torch.set_num_threads(recipe.threads or max(1, (os.cpu_count() or 1) // _ranks_here))  # no oversubscription
    dtype = torch.bfloat16 if recipe.dtype == "bf16" else torch.float32
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    engine = TorchEngine.from_checkpoint(recipe.target, recipe.drafter, recipe.method, recipe.max_seq_len,
                                         recipe.cache_dir, device=device, dtype=dtype, shard=shard)
    if recipe.calibrate_tokens:
        engine.calibrate_cost_model(recipe.calibrate_tokens, retries=0)  # retries follow each rank's own times
    return engine, load_tokenizer(engine.checkpoint_dir)


class LockstepDecoder(SpeculativeDecoder):
    """A :class:`~clover.decode.SpeculativeDecoder` whose rank 0 leads and whose other ranks follow
    (:meth:`follow`). Rank 0 is used as any decoder (``submit``, ``cancel``, ``step``, ``generate``); the
    decode step itself is the base class's, unchanged."""

    def __init__(self, engine, method: str = "clover", tree: TreeConfig | None = None, tokenizer=None,
                 max_batch_size: int = 64, prefill_chunk_tokens: int = 2048,
                 max_step_tokens: int | None = None) -> None:
        self.leads = dist.get_rank() == 0
        settings = _broadcast(dict(method=method, tree=tree, max_batch_size=max_batch_size,
                                   prefill_chunk_tokens=prefill_chunk_tokens, max_step_tokens=max_step_tokens,
                                   cost_model=getattr(engine, "cost_model", None)) if self.leads else None)
        # step_timing off: measured times differ per rank, and the budget they choose must not
        super().__init__(engine, tokenizer=tokenizer, step_timing=False, **settings)
        self._submitted: list[GenerationRequest] = []
        self._cancels: list[int] = []

    def submit(self, request: GenerationRequest, validated: bool = False) -> int:
        seq_id = super().submit(request, validated)
        self._submitted.append(request)
        return seq_id

    def cancel(self, seq_id: int) -> None:
        super().cancel(seq_id)
        self._cancels.append(seq_id)

    def step(self, on_prefill=None):
        if self.leads:  # the followers apply the same changes, so their sequence ids match
            _broadcast((self._submitted, self._cancels))
            self._submitted, self._cancels = [], []
        # on_prefill only delivers events early: every rank admits and computes the same either way
        return super().step(on_prefill)

    def release(self) -> None:
        """Rank 0: end the followers' :meth:`follow` of this decoder (the next one may start)."""
        if self.leads:
            _broadcast(_STOP)

    def follow(self) -> None:
        """The other ranks' loop: rank 0's changes, then the same step, until rank 0 leaves (:func:`leave`)."""
        while (plan := _broadcast()) != _STOP:
            submitted, cancels = plan
            for request in submitted:
                SpeculativeDecoder.submit(self, request, validated=True)
            for seq_id in cancels:
                SpeculativeDecoder.cancel(self, seq_id)
            super().step()


def follow(rendezvous: Rendezvous, rank: int) -> int:
    """A follower rank's life: join, load what rank 0 loads, follow its steps. Exit code 0 when rank 0 closed."""
    shard = join(rendezvous, rank)
    try:
        engine, tokenizer = load_engine(None, shard)
        LockstepDecoder(engine, tokenizer=tokenizer).follow()
    finally:
        leave()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m clover.lockstep``: one follower (``--rank``), or this host's ranks (``--node-rank`` > 0)."""
    parser = argparse.ArgumentParser(prog="python -m clover.lockstep", description=__doc__)
    add_rendezvous_options(parser)
    parser.add_argument("--rank", type=int, default=None, help="run this one rank (default: this host's ranks)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[clover rank %(process)d] %(message)s")
    rendezvous = rendezvous_of(args)
    if args.rank is not None:
        return follow(rendezvous, args.rank)
    if args.node_rank == 0:
        raise ConfigError("host 0 runs rank 0: start clover generate or clover serve there")
    procs = start_followers(dataclasses.replace(rendezvous, node_rank=args.node_rank))
    try:
        return max(proc.wait() for proc in procs)
    finally:
        stop_followers(procs)


if __name__ == "__main__":
    sys.exit(main())
