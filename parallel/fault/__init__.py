"""Fault tolerance as a plug-in of the engine: ring replication of KV, heartbeats, recovery.

- ``ring.py``: :class:`RingReplication`, every rank's KV mirrored on its ring successor;
- ``heartbeat.py``: :class:`Heartbeat`, a dead or hung rank detected through the job's store;
- ``recovery.py``: :class:`FaultTolerance`, the token journal, replay and KV restore after a restart;
- ``restart.py``: torchrun's attempt count and a store prefix per attempt;
- ``inject.py``: failures on purpose (``fault.kill_at``, ``fault.inject=hang``).
"""

from reshard.parallel.fault.heartbeat import Heartbeat
from reshard.parallel.fault.inject import inject_kill
from reshard.parallel.fault.recovery import FaultTolerance, remove_orphans
from reshard.parallel.fault.restart import job_store, restart_count
from reshard.parallel.fault.ring import RingReplication

__all__ = [
    "FaultTolerance",
    "Heartbeat",
    "RingReplication",
    "inject_kill",
    "job_store",
    "remove_orphans",
    "restart_count",
]
