"""The processes of one tensor-parallel server: joined into a torch.distributed group, rank 0 sending them calls.

The model's own collectives run over the default group (gloo on CPUs, NCCL on GPUs); the calls rank 0 sends go
over a separate gloo group, as pickled Python objects, so on a GPU they never wait behind the model's kernels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from transformers_openai.parallel.rendezvous import LoopbackRendezvous

# A rank waits for rank 0's next call as long as the server is idle; a rank that dies is noticed by its peers'
# broken connections and by the launcher, not by this timeout.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the `size` ranks, and the group rank 0's calls go over."""

    rank: int
    size: int
    control: Any  # a torch.distributed ProcessGroup (gloo)

    def send(self, message: object) -> None:
        """Rank 0: hands `message` to every other rank (each gets it from `receive`)."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> object:
        """A rank other than 0: waits for rank 0's next message."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (what all of them can hold)."""
        tensor = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())


def join_ranks(size: int, rendezvous: LoopbackRendezvous | None = None) -> Ranks:
    """Joins the group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which our
    launcher sets the same way; on a GPU machine each rank takes the GPU LOCAL_RANK names. Rank 0 of a server that
    started its own ranks serves the group's store on loopback (its `rendezvous`); the others connect to it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != size:
        raise RuntimeError(
            f"--tensor-parallel-size {size} needs {size} processes, but WORLD_SIZE is {world}: start the server "
            f"without torchrun (it starts its ranks itself) or with torchrun --nproc-per-node {size}"
        )
    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        if rendezvous is None:
            dist.init_process_group(backend)  # env://: torchrun's store, or a client of our rank 0's
        else:
            dist.init_process_group(backend, store=rendezvous.store(size), rank=0, world_size=size)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Ranks(rank=dist.get_rank(), size=size, control=control)
