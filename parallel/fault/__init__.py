"""Fault tolerance: supervised ranks (``fault.migrate``), failures kept inside their engine group.

- ``supervisor.py``: :class:`Supervisor`, each rank's engine run as a child and respawned in the job;
- the job's one router (:class:`reshard.parallel.engine.router.Router`) moves a dead generation's
  requests on (with their KV, re-prefilled, or held for the group's respawn): a failure is one of
  its events;
- ``mirror.py``: :class:`KVMirror`, each rank's KV streamed to a peer group's rank of the same
  position, and the engine's KV connector for requests resumed from it;
- ``host.py``: :class:`MirrorHost`, a lockstep group's KV kept by its supervisors for its next generation;
- ``donor.py``: weights for a respawned rank from a live replica;
- ``journal.py``: each group's agreed tokens and heartbeat in the job's store;
- ``restart.py``: torchrun's attempt count and a store prefix per attempt;
- ``inject.py``: failures on purpose (``fault.kill_at``, ``fault.inject=hang``).
"""

from reshard.parallel.fault.inject import inject_kill
from reshard.parallel.fault.restart import job_store, restart_count

__all__ = ["inject_kill", "job_store", "restart_count"]
