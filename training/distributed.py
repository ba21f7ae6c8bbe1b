"""Data-parallel training over torch.distributed: ``torchrun --nproc_per_node N -m training.train ...``.

Every process (rank) holds the frozen target and a replica of the drafter. One optimizer step
reads one batch of the plan (:func:`training.batches.make_plan`, the same for any number of
processes) and splits its conversations round-robin into ``N x grad_accum`` micro-batches; rank r
runs micro-batches ``r * grad_accum ... (r + 1) * grad_accum - 1``. The loss is normalised by
the label counts of the whole batch (summed over ranks before any backward pass), so N
processes, or gradient accumulation, give the weights one process gets on the whole batch, up to
floating-point summation order (tests/test_training_distributed.py).

Gradients are summed with one ``all_reduce`` per step after the step's backward passes, not by
``DistributedDataParallel``'s hooks: :func:`training.forward.run_batch` runs several backward
passes per step (the LM-head chunks, then the Augmenting Block once), and DDP's reducer allows
one gradient per parameter per forward ("Expected to mark a variable ready only once").
The collective is the one DDP would issue, without its overlap with the backward pass; the
drafter's gradients are small next to the target's forward (docs/train-your-own.md).
Backends: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Distributed:
    """This process's place in the job; the identity (rank 0 of 1) without torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this process created the process group and destroys it at the end

    @classmethod
    def from_env(cls, device_type: str) -> "Distributed":
        """Join the job torchrun described in the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``MASTER_ADDR``/``MASTER_PORT``), or the process group the caller already made."""
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            return cls(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        return cls(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")), owns_group=True)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs and the final heads."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """This rank's GPU (``cuda:LOCAL_RANK``) when ``device`` is CUDA without an index."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def micro_batches(self, indices: list[int], grad_accum: int) -> list[list[int]]:
        """This rank's ``grad_accum`` shares of one plan batch (some may be empty when the batch is small)."""
        parts = self.world_size * grad_accum
        return [indices[j::parts] for j in range(self.rank * grad_accum, (self.rank + 1) * grad_accum)]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over ranks, in place."""
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, value: float, device: torch.device) -> float:
        if not self.active:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor)

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks with one all_reduce. A parameter no rank has a
        gradient for keeps ``grad = None`` (AdamW then skips it, as in one process)."""
        if not self.active:
            return
        device = params[0].device
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float32, device=device)
        flat = torch.cat([present] + [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                                      for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        has_grad, offset = flat[: len(params)].tolist(), len(params)
        for p, present_somewhere in zip(params, has_grad):
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).to(p.dtype) if present_somewhere else None
            offset += n

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (any picklable object)."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def end_torchrun_rank(code: int) -> int:
    """Return ``code`` from a command; under torchrun (``WORLD_SIZE`` > 1), end the process with it at once,
    without the interpreter's teardown: a gloo rank's exit-time destructors aborted it now and then after all its
    work was done ("terminate called without an active exception", about 1 run in 15 on 2 CPU cores), and
    torchrun then failed the whole job."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
