"""Where the ranks of a tensor-parallel server started without torchrun meet: a TCPStore on 127.0.0.1 only.

torch's TCPStore has no authentication, and given a host name it still listens on every interface (torch 2.13,
both server backends: `ss -ltn` shows `*:port`), so anyone who reaches the machine could write into rank 0's
store. Rank 0 therefore binds the store's socket itself, to loopback, before it starts the other ranks, and the
store serves that socket alone (`master_listen_fd`). The other ranks connect to it as torchrun's would
(MASTER_ADDR/MASTER_PORT). Under torchrun the ranks use torchrun's store, which torchrun's flags place.
"""

from __future__ import annotations

import socket
from datetime import timedelta

# Where torch's typing declares the stores (torch.distributed re-exports them without declaring it).
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

LOOPBACK = "127.0.0.1"
# init_process_group prefixes the keys of a store it made itself (env://, which the other ranks join through) with
# this; rank 0 handing it a store must key it the same way, or the ranks wait for each other's keys forever.
ENV_STORE_PREFIX = "default_pg"
# torch.distributed's default for gloo's groups and their store: the other ranks must start within it.
STORE_TIMEOUT = timedelta(minutes=30)


class LoopbackRendezvous:
    """Rank 0's listening socket for the group's store, bound to 127.0.0.1 on a free port that stays reserved
    until the store takes it over (no other process can take the port between the two)."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((LOOPBACK, 0))
        self._socket.listen(128)
        self.port: int = self._socket.getsockname()[1]

    def env(self, size: int) -> dict[str, str]:
        """The variables every rank joins with (torchrun's names): where the store is and how many ranks meet."""
        return {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(self.port), "WORLD_SIZE": str(size)}

    def store(self, size: int, timeout: timedelta = STORE_TIMEOUT) -> Store:
        """Rank 0's store for init_process_group, serving the loopback socket, its keys where the other ranks look
        for them; waits until the other `size - 1` ranks connected."""
        if self._socket is None:
            raise RuntimeError("the rendezvous store was made already")
        fd = self._socket.detach()  # the store's server owns the descriptor from now on, and closes it
        self._socket = None
        server = TCPStore(LOOPBACK, self.port, size, True, timeout, master_listen_fd=fd)
        return PrefixStore(ENV_STORE_PREFIX, server)
