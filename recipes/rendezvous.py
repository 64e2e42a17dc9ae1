"""How the machines of ``reshard ... --nnodes M`` find each other: torchrun's static rendezvous
(node 0 hosts the store on ``--master-addr:--master-port``, each node names its ``--node-rank``)
that says what it waits for and gives up after ``--rdzv-timeout`` seconds with one line
(:class:`NodesMissing`), where torchrun's waits in silence. The launcher registers it with
torch's rendezvous registry (:func:`register`) and names :data:`BACKEND` in its ``LaunchConfig``."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

from torch.distributed import DistError, PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "reshard-nodes"
JOINED = "reshard/node-joined/"  # + the node's rank, set by each node once it reaches node 0's store
OUTCOME = "reshard/rendezvous"  # DONE, or the line saying which nodes did not join: set once
DONE = "done"
TOLD = "reshard/node-told/"  # + the node's rank: it read a failed outcome (node 0 may close its store)
TELL_S = 5.0  # how long node 0 keeps its store up for the others to read a failed outcome
STORE_TIMEOUT = datetime.timedelta(seconds=900)  # the store's operations once every node joined (torchrun's)
POLL_S = 0.2


class NodesMissing(RuntimeError):
    """The job's nodes did not all join within the rendezvous timeout; the message is one line."""


class NodeRendezvous(RendezvousHandler):
    """One node's side of the rendezvous (the agent calls :meth:`next_rendezvous` once per start
    of its ranks; the nodes meet on the first call only, later ones reuse the store)."""

    def __init__(self, addr: str, port: int, rank: int, nnodes: int, run_id: str, timeout_s: float) -> None:
        self.addr, self.port, self.rank, self.nnodes = addr, port, rank, nnodes
        self.run_id, self.timeout_s = run_id, timeout_s
        self._store: Store | None = None

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """The job's store (node 0's), once every node has joined; :class:`NodesMissing` after
        ``timeout_s`` seconds otherwise."""
        if self._store is None:
            self._store = self._join(time.monotonic() + self.timeout_s)
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, self.rank, self.nnodes, RendezvousStoreInfo(self.addr, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True

    def _join(self, deadline: float) -> TCPStore:
        """Node 0's store (hosted here on node 0, reached on the others) once the nodes agreed that
        every one of them has joined; :class:`NodesMissing` with the line of the node that gave up."""
        if self.rank == 0:
            store = TCPStore(self.addr, self.port, None, True, STORE_TIMEOUT, wait_for_workers=False, multi_tenant=True)
        else:
            store = self._reach(deadline)
        try:
            store.set(f"{JOINED}{self.rank}", "1")
            outcome = self._await_outcome(store, deadline)
            if outcome != DONE and self.rank == 0:  # its store stays up until the others have read why
                self._await_told(store)
            elif outcome != DONE:
                store.set(f"{TOLD}{self.rank}", "1")
            if outcome != DONE:
                raise NodesMissing(outcome)
        except DistError as e:  # node 0 stopped without a word while this node waited
            raise NodesMissing(f"node 0 at {self.where} went away during the rendezvous ({_first_line(e)})") from None
        store.set_timeout(STORE_TIMEOUT)
        return store

    def _await_outcome(self, store: Store, deadline: float) -> str:
        """:data:`DONE`, or the line saying which nodes did not join: decided once for every node
        (``compare_set``), by node 0 when all have joined or by the first node whose ``deadline``
        passes with some missing. One line while waiting."""
        said = False
        while not store.check([OUTCOME]):
            missing = [r for r in range(self.nnodes) if not store.check([f"{JOINED}{r}"])]
            if not missing and self.rank == 0:
                return store.compare_set(OUTCOME, "", DONE).decode()
            if missing and time.monotonic() >= deadline:
                return store.compare_set(OUTCOME, "", self._missing_line(missing)).decode()
            if missing and not said:
                timeout = f"--rdzv-timeout {self.timeout_s:g} s"
                _say(f"waiting for {len(missing)} more node(s) at {self.where} ({timeout})...")
                said = True
            time.sleep(POLL_S)
        return store.get(OUTCOME).decode()

    def _missing_line(self, missing: list[int]) -> str:
        return (
            f"{len(missing)} of {self.nnodes} nodes did not join within {self.timeout_s:g} s: no "
            f"--node-rank {', '.join(map(str, missing))} at {self.where} (start each on its machine with the "
            f"same --master-addr and --master-port, or raise --rdzv-timeout)"
        )

    def _await_told(self, store: Store) -> None:
        """Node 0, the rendezvous failed: return once every node that joined has read the outcome
        (or after :data:`TELL_S`), so that none finds the store gone instead."""
        joined = [r for r in range(1, self.nnodes) if store.check([f"{JOINED}{r}"])]
        until = time.monotonic() + TELL_S
        while joined and not store.check([f"{TOLD}{r}" for r in joined]) and time.monotonic() < until:
            time.sleep(POLL_S / 4)

    def _reach(self, deadline: float) -> TCPStore:
        """A client of node 0's store, once something listens at its address (a plain connect
        until then: no store errors logged per try)."""
        said = False
        while not _listening(self.addr, self.port):
            if time.monotonic() >= deadline:
                raise NodesMissing(
                    f"node 0 did not answer at {self.where} within {self.timeout_s:g} s (start it with "
                    f"--node-rank 0 and the same --master-addr and --master-port, or raise --rdzv-timeout)"
                )
            if not said:
                _say(f"waiting for node 0 at {self.where} (--rdzv-timeout {self.timeout_s:g} s)...")
                said = True
            time.sleep(POLL_S)
        left = max(deadline - time.monotonic(), 1.0)
        foreign = f"{self.where} did not answer as node 0's rendezvous within {self.timeout_s:g} s"
        try:
            with _exit_after(left, f"{foreign} (something else listens there?)"):
                return TCPStore(self.addr, self.port, None, False, datetime.timedelta(seconds=left))
        except DistError as e:  # something else listens there, and answered
            raise NodesMissing(f"{foreign} ({_first_line(e)})") from None


def create_handler(params: RendezvousParameters) -> NodeRendezvous:
    """The handler the registry builds from ``LaunchConfig``'s ``rdzv_endpoint`` (``addr:port``)
    and ``rdzv_configs`` (``rank``, ``timeout`` in seconds)."""
    addr, port = params.endpoint.rsplit(":", 1)
    timeout_s = float(params.config["timeout"])
    return NodeRendezvous(addr, int(port), int(params.config["rank"]), params.max_nodes, params.run_id, timeout_s)


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (again: no change)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)


@contextlib.contextmanager
def _exit_after(seconds: float, message: str) -> Iterator[None]:
    """Run the block; if it is still running after ``seconds``, print ``error: message`` and end
    the process (status 1). For the store's client, whose handshake waits without a timeout on a
    listener that accepts and never answers; nothing has started yet, so there is nothing to clean."""

    def give_up() -> None:
        _say(f"error: {message}")
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
