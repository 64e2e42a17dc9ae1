"""A supervised rank's fork server, forked from the rank itself before its process group starts.

multiprocessing starts its fork server as ``python -c ...``, which imports torch, transformers and
the stack again (about 4 s of CPU per supervised rank here) although the rank that asks for it
imported them already. :func:`fork_server` forks the server from the rank instead, once its
imports are done and before it starts threads of its own (its process group's), so the server
holds the rank's imports and nothing the rank builds later. The supervisor then finds the server
running (:func:`reshard.parallel.fault.supervisor._context`) and forks every child from it as
before: the children, the server's protocol and its end (with the rank: the alive pipe) are
multiprocessing's own.

The local ranks of a node share one server (:func:`fork_node_server`, :func:`attach`): its
preload (transformers and the model's module, about 4 s of CPU here) is imported once a node,
not once a rank. The first local rank forks it and hands the others its address and a write end
of its alive pipe, so it ends when every rank of the node and every child it forked have.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import connection, forkserver, reduction, resource_tracker, util

import torch

PAUSED = "reshard.parallel.fault.paused"  # a preload's first import: the cyclic collector paused
FROZEN = "reshard.parallel.fault.frozen"  # its last: what it imported frozen, the collector resumed


def frozen_preload(modules: Sequence[str]) -> tuple[str, ...]:
    """A fork server's preload of ``modules``: imported with the cyclic collector paused, then
    frozen (never garbage: the server's final collection and its children's skip them)."""
    return (PAUSED, *modules, FROZEN)


@dataclass(frozen=True)
class NodeShare:
    """How a node's local ranks share one fork server: ``address`` (an abstract ``AF_UNIX`` name
    unique to the node's launcher and attempt) is where the ``first`` rank hands the server out to
    the other ``ranks - 1``."""

    address: str
    ranks: int
    first: bool


def forkable() -> bool:
    """Whether this process may fork multiprocessing's fork server itself: none runs yet, this
    Python's server takes only the listener and the alive pipe, and torch is a CPU build (a fork
    of a process that touched a CUDA or ROCm driver cannot use the device: there multiprocessing
    starts its server afresh when first asked)."""
    if forkserver._forkserver._forkserver_pid is not None:
        return False
    if tuple(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMETERS:
        return False
    return torch.version.cuda is None and torch.version.hip is None


def fork_server(preload: Sequence[str] = (), here: bool = False) -> bool:
    """Fork multiprocessing's fork server from this process, with ``preload`` (modules) imported
    in it; call it before this process starts threads (its process group). ``here``: import them
    in this process first, which needs them itself (the server then inherits them: once, not
    twice); else the server imports them while this process goes on. Returns whether it forked
    the server (not where :func:`forkable` says no; then ``here`` imports nothing)."""
    if not forkable():
        return False
    for module in preload if here else ():
        with contextlib.suppress(ImportError):  # (a guess that misses, skipped as the server skips it)
            importlib.import_module(module)
    resource_tracker.ensure_running()  # its own process, as multiprocessing starts it for a server
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w has: this process
    sys.stdout.flush()  # (what is buffered would be printed again by the server's children)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _serve(listener.fileno(), alive_r, alive_w, tuple(preload))
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def fork_node_server(preload: Sequence[str], here: bool, share: NodeShare) -> socket.socket | None:
    """The node's first local rank: :func:`fork_server`, and the listener (at ``share.address``)
    the node's other ranks take it from once every rank joined the process group
    (:func:`hand_out`). None where it forked no server (then nor does any rank of the node share
    one: each has multiprocessing's own, started when first asked)."""
    if not fork_server(preload, here):
        return None
    handout = socket.socket(socket.AF_UNIX)  # (after the fork: the server does not hold it)
    try:
        handout.bind(share.address)
    except OSError:  # (held by a process not of this job: the other ranks keep their own servers)
        handout.close()
        return None
    handout.listen(share.ranks)
    return handout


def hand_out(handout: socket.socket | None, share: NodeShare, timeout: float) -> None:
    """The first local rank, after the process group started (so the other ranks came): hand the
    server's address and a write end of its alive pipe to each of them (at most ``timeout``
    seconds for one that does not ask: it starts a server of its own), then close ``handout``.
    Without a server (``handout`` None) the others find nobody and start their own."""
    if handout is None:
        return
    server = forkserver._forkserver
    handout.settimeout(timeout)
    with handout, contextlib.suppress(TimeoutError):
        for _ in range(share.ranks - 1):
            peer, _ = handout.accept()
            with peer:
                reduction.sendfds(peer, [server._forkserver_alive_fd])
                peer.sendall(server._forkserver_address.encode())


def attach(share: NodeShare, timeout: float) -> bool:
    """A local rank other than the first, after the process group started: start children from
    the node's server (the first rank's, taken from ``share.address``) instead of one of its own.
    Returns False where there is none to take (the first rank forked none, or a process of
    another user answers): then multiprocessing starts this rank's own when first asked."""
    if forkserver._forkserver._forkserver_pid is not None:
        return False
    with socket.socket(socket.AF_UNIX) as peer:
        peer.settimeout(timeout)
        try:
            peer.connect(share.address)
        except OSError:  # (nobody there: the first rank's server was not forked)
            return False
        if _peer_uid(peer) != os.getuid():
            return False
        (alive_w,) = reduction.recvfds(peer, 1)
        address = _read_all(peer).decode()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = -1  # another rank's child: this rank cannot wait for it
    # multiprocessing's own check (before each child) waits on the server's pid, which only its
    # parent may; here there is nothing to check or restart, only this rank's resource tracker
    server.ensure_running = resource_tracker.ensure_running
    return True


class FromParent:
    """What a fork server's child takes from the process that asked for it, not from the server
    (which another rank of the node may have forked): the environment (``RANK``, ``LOCAL_RANK``,
    torchrun's error file), stdout and stderr. Made in the asking process and pickled with the
    child's arguments (the two descriptors travel with them); :meth:`apply` in the child."""

    def __init__(self, env: dict[str, str] | None = None, out: int = 1, err: int = 2) -> None:
        self.env = dict(os.environ) if env is None else env
        self.out, self.err = out, err

    def __reduce__(self):
        return _from_parent, (self.env, reduction.DupFd(self.out), reduction.DupFd(self.err))

    def apply(self) -> None:
        """In the child, first: its environment, stdout and stderr become the asking process's."""
        os.environ.clear()
        os.environ.update(self.env)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in ((self.out, 1), (self.err, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _from_parent(env: dict[str, str], out, err) -> FromParent:
    return FromParent(env, out.detach(), err.detach())


def _peer_uid(peer: socket.socket) -> int:
    """The user id of the process at the other end of ``peer`` (``SO_PEERCRED``: pid, uid, gid)."""
    cred = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", cred)[1]


def _read_all(peer: socket.socket) -> bytes:
    chunks = []
    while chunk := peer.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


# forkserver.main's parameters in the Pythons whose server this forks (3.10 to 3.12); a later
# one's (an authentication key's pipe) leaves the server to multiprocessing
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: tuple[str, ...]) -> None:
    """The server's life, in the forked process: signals as a new interpreter's (its children
    inherit them), then multiprocessing's server loop until the rank ends; never returns."""
    try:
        os.close(alive_w)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        forkserver.main(listener_fd, alive_r, list(preload))
    finally:
        os._exit(0)  # no teardown of what the rank had built before the fork
