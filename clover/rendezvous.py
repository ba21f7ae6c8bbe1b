"""Where the ranks of a tensor-parallel target meet, and how one host starts its own (torchrun's names:
``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``; docs/serving.md#several-hosts).

No torch here: ``clover --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from clover.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet (torchrun's names). ``world_size``: the tensor-parallel degree."""

    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    nnodes: int = 1
    node_rank: int = 0

    @property
    def ranks_per_node(self) -> int:
        if self.world_size % self.nnodes:
            raise ConfigError(f"--tensor-parallel {self.world_size} does not divide over --nnodes {self.nnodes}")
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this host runs."""
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child: SIGTERM when the parent dies, so no rank outlives its launcher (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_followers(rendezvous: Rendezvous, log_file: Path | None = None) -> list[subprocess.Popen]:
    """Start this host's ranks other than 0, each ``python -m clover.lockstep``, in sessions of their own
    (a terminal's Ctrl-C reaches only the launcher, which stops rank 0 first: the others then leave with
    it); output to ``log_file`` with ``.rank<N>`` added, else inherited."""
    procs = []
    for rank in rendezvous.local_ranks:
        if rank == 0:
            continue
        command = [sys.executable, "-m", "clover.lockstep", "--rank", str(rank),
                   "--tensor-parallel", str(rendezvous.world_size), "--master-addr", rendezvous.master_addr,
                   "--master-port", str(rendezvous.master_port), "--nnodes", str(rendezvous.nnodes)]
        output = open(f"{log_file}.rank{rank}", "w") if log_file is not None else None
        procs.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if output else None,
                                      preexec_fn=_die_with_parent, start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return procs


def stop_followers(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Reap the given rank processes: those told to stop get ``grace_s`` seconds, then SIGTERM, then SIGKILL
    (no orphans)."""
    for signal_them in (None, subprocess.Popen.terminate, subprocess.Popen.kill):
        for proc in procs:
            if signal_them is not None and proc.poll() is None:
                signal_them(proc)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        if all(proc.poll() is not None for proc in procs):
            return


def add_rendezvous_options(parser: argparse.ArgumentParser) -> None:
    """torchrun's rendezvous options, for ``clover generate|serve`` and ``python -m clover.lockstep``."""
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the target over N ranks (torch backend; docs/serving.md#tensor-parallel)")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts the ranks run on (as torchrun)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's index (0: the one with rank 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's host, where the ranks meet")
    parser.add_argument("--master-port", type=int, default=0, help="its TCP port (0: a free one; give one "
                        "with --nnodes > 1)")


def rendezvous_of(args) -> Rendezvous:
    if args.tensor_parallel < 1:
        raise ConfigError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.nnodes > 1 and not args.master_port:
        raise ConfigError("--nnodes > 1 needs --master-port (the same on every host)")
    return Rendezvous(args.tensor_parallel, args.master_addr, args.master_port or free_port(args.master_addr),
                      args.nnodes, args.node_rank)
