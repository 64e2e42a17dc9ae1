"""A fork server forked from the rank itself: supervised children start with its imports done.

:class:`~reshard.parallel.fault.supervisor.Supervisor` starts its children from multiprocessing's
fork server. That server is a fresh interpreter that imports torch, transformers and the engine
again (about 4.5 s of CPU per rank, while the rank waits). :func:`fork_server_here` makes the
server a fork of the calling process instead (a *zygote*): everything the process imported is
there at no cost, and the children the server forks inherit it. Call it while the process has
one thread and has not joined a process group (before ``init_process_group``): the fork copies
only the calling thread, and a child must build its own process group. A torch built with CUDA
keeps the fresh server (a fork of a process that touched the driver cannot use CUDA).

The children are the server's, exactly as with the fresh server: multiprocessing's own server
loop runs in the zygote, reports their exit codes and exits when its client process does.
"""

from __future__ import annotations

import gc
import inspect
import os
import signal
import socket
import threading
from multiprocessing import connection, forkserver, resource_tracker, util

# the stdlib server loop's parameters this module drives (CPython 3.11's); another signature
# (a Python whose loop takes more, e.g. an authentication key) keeps the fresh server
_MAIN_PARAMS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")


def fork_server_here() -> int | None:
    """Start this process's multiprocessing fork server as a fork of this process; its pid, or
    ``None`` where it is not started so (already running, several threads, a torch that may use
    CUDA, or a Python whose server loop differs): children then start from the usual fresh server,
    only slower."""
    server = forkserver._forkserver
    if tuple(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMS or threading.active_count() > 1:
        return None
    if _may_use_cuda():
        return None
    with server._lock:
        if server._forkserver_pid is not None:
            return None
        resource_tracker.ensure_running()  # before the fork: the children share this process's tracker
        gc.freeze()  # what is imported by now: the collector of every child skips it
        address, alive_w, pid = _fork_serving()
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def _may_use_cuda() -> bool:
    """A torch built with CUDA or ROCm: a child forked from a process in which anything touched
    the driver cannot initialize CUDA, so such a process keeps the fresh server."""
    import torch

    return torch.version.cuda is not None or torch.version.hip is not None


def _fork_serving() -> tuple[str, int, int]:
    """Fork the server loop over a fresh listening socket: (its address, this process's end of
    the pipe whose closing ends the server, the server's pid)."""
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote: serve until this process's end of the pipe closes
            os.close(alive_w)
            # a fresh interpreter's handlers, which the server restores in each child it forks
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                forkserver.main(listener.fileno(), alive_r, preload=[])
            finally:
                os._exit(0)
        os.close(alive_r)
    return address, alive_w, pid
