"""A supervised rank's fork server, forked from the rank itself before its process group starts.

multiprocessing starts its fork server as ``python -c ...``, which imports torch, transformers and
the stack again (about 4 s of CPU per supervised rank here) although the rank that asks for it
imported them already. :func:`fork_server` forks the server from the rank instead, once its
imports are done and before it starts threads of its own (its process group's), so the server
holds the rank's imports and nothing the rank builds later. The supervisor then finds the server
running (:func:`reshard.parallel.fault.supervisor._context`) and forks every child from it as
before: the children, the server's protocol and its end (with the rank: the alive pipe) are
multiprocessing's own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import signal
import socket
import sys
from collections.abc import Sequence
from multiprocessing import connection, forkserver, resource_tracker, util

import torch

PAUSED = "reshard.parallel.fault.paused"  # a preload's first import: the cyclic collector paused
FROZEN = "reshard.parallel.fault.frozen"  # its last: what it imported frozen, the collector resumed


def frozen_preload(modules: Sequence[str]) -> tuple[str, ...]:
    """A fork server's preload of ``modules``: imported with the cyclic collector paused, then
    frozen (never garbage: the server's final collection and its children's skip them)."""
    return (PAUSED, *modules, FROZEN)


def fork_server(preload: Sequence[str] = (), here: bool = False) -> bool:
    """Fork multiprocessing's fork server from this process, with ``preload`` (modules) imported
    in it; call it before this process starts threads (its process group). ``here``: import them
    in this process first, which needs them itself (the server then inherits them: once, not
    twice); else the server imports them while this process goes on. Returns whether it forked
    the server: False where a server runs already, where this Python's server takes more than the
    listener and the alive pipe, or with a CUDA or ROCm build of torch (then multiprocessing
    starts one itself when first asked, and ``here`` imports nothing)."""
    server = forkserver._forkserver
    if server._forkserver_pid is not None or tuple(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMETERS:
        return False
    if torch.version.cuda is not None or torch.version.hip is not None:  # a fork of a process that
        return False  # touched the driver cannot use the device: the server starts afresh there
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
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


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
