"""A two-rank gloo process group for point-to-point messages between two generations of engine
groups that do not step together (KV mirrors, weight donors)."""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

LINK_TIMEOUT = datetime.timedelta(days=1)  # a quiet link is not a dead one


class Link:
    """A two-rank gloo process group named ``name`` in ``store``: ``side`` 0 sends, 1 receives.
    The group is built on first use, by the thread that uses the link (so building a link never
    blocks its owner, whether gloo connects then or, ``TORCH_GLOO_LAZY_INIT``, at the first
    message). A message is a header (two sizes), pickled metadata and a byte buffer. Waits block
    (a gloo wait with a timeout breaks the connection): a link whose peer died before it
    connected blocks its thread for good. :meth:`close` drops this end's group; an operation still
    blocked on it holds it until it returns (a gloo group torn down with an operation pending
    aborts the process), and the link's next operation raises ``RuntimeError``."""

    def __init__(self, store: dist.Store, name: str, side: int) -> None:
        self.store, self.name, self.side, self.peer = store, name, side, 1 - side
        self._pg: dist.ProcessGroup | None = None
        self._closed = False

    def _group(self) -> dist.ProcessGroup:
        if self._closed:
            raise RuntimeError(f"link {self.name} is closed")
        if self._pg is None:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(self.name, self.store), self.side, 2, LINK_TIMEOUT)
        return self._pg

    def send(self, meta, data: torch.Tensor) -> None:
        pg = self._group()  # held until the message is out, whatever close() does meanwhile
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        header = torch.tensor([blob.numel(), data.numel()], dtype=torch.int64)
        for t in (header, blob, data.cpu()):
            pg.send([t], self.peer, 0).wait()

    def recv(self) -> tuple[object, torch.Tensor]:
        """The next message: its metadata and bytes."""
        pg = self._group()  # held until the message is in, whatever close() does meanwhile
        header = torch.empty(2, dtype=torch.int64)
        pg.recv([header], self.peer, 0).wait()
        blob, data = torch.empty(int(header[0]), dtype=torch.uint8), torch.empty(int(header[1]), dtype=torch.uint8)
        pg.recv([blob], self.peer, 0).wait()
        pg.recv([data], self.peer, 0).wait()
        return pickle.loads(blob.numpy().tobytes()), data

    def close(self) -> None:
        """Drop this end's group (its peer's next operation fails); idempotent."""
        self._closed, self._pg = True, None
