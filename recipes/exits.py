"""How a job ends, as the launcher and the ranks both say it (the standard library only: the
launcher reads this before it imports torch, so Ctrl-C at any moment is one line)."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

LAUNCHED_ENV = "RESHARD_LAUNCHER"  # set for ranks started by the ``reshard`` command (recipes/cli.py)
LAUNCHER_PID_ENV = "RESHARD_LAUNCHER_PID"  # the ``reshard`` command's pid, its ranks' parent (recipes/rank.py)
EXIT_USER, EXIT_INTERRUPTED = 2, 130  # a user error; Ctrl-C (128 + SIGINT, as a shell reports it)
FINISHED = "finished.jsonl"  # each request, as it finishes, in the run directory (kept if the job dies)
RANKS_LOG = "ranks.log"  # in the run directory: the tracebacks of ranks and engines that did not say them
# how a rank that was stopped ends: Ctrl-C, the launcher's SIGTERM once another rank failed (caught:
# 130, or not yet: the signal), or a peer's failure that cut its collective short (130)
STOPPED = (EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT)
IMPORT_WAIT_S = 5.0  # the longest a stop waits for an import it landed in (then it interrupts it)
IMPORT_RECHECK_S = 0.05


def freeze_heap() -> None:
    """Call once imports are done: the cyclic garbage collector stops walking every object alive
    now (the imports' modules and classes, 0.49 -> 0.13 s of collections in a default
    ``generate`` run after its imports) and, at exit, every object alive then (its final passes
    over torch's and transformers' objects: 1.18 -> 0.17 s from the end of ``import
    reshard.recipes.generate`` to the exit). Objects made later are collected as before;
    reference counting, ``atexit`` handlers and ``finally`` blocks run as before. The collector
    runs again from here: a job started as ``python -m reshard.recipes.<job>`` imported with it
    paused (:mod:`reshard.recipes`)."""
    gc.freeze()
    gc.enable()
    atexit.unregister(gc.freeze)  # (once, however often it is called)
    atexit.register(gc.freeze)


@dataclasses.dataclass
class AfterImport:
    """Holds back a stop that lands inside an ``import`` until the import is done. Interrupted
    there, ``KeyboardInterrupt`` is not what comes out: Python 3.11 turns it into a
    ``RuntimeError`` when it hits a ``__set_name__``, and libraries catch it on their lazy
    imports and print their own line (huggingface_hub: ``Error importing
    huggingface_hub.hf_api: ...`` on stdout, a second line on a Ctrl-C). A signal handler calls
    :meth:`defer` first: ``True`` means the signal comes back to it in :data:`IMPORT_RECHECK_S`
    (sent to the main thread again, so that a blocking call there returns), for at most
    :data:`IMPORT_WAIT_S` from the first stop."""

    since: float | None = None
    pending: bool = False

    def defer(self, signum: int, frame: FrameType | None) -> bool:
        """Whether the handler should return without stopping (``frame``: the one it got)."""
        if not importing(frame):
            return False
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since > IMPORT_WAIT_S:
            return False
        if not self.pending:  # (a second signal meanwhile: the one delivery stands for both)
            self.pending = True
            timer = threading.Timer(IMPORT_RECHECK_S, self._again, (signum,))
            timer.daemon = True
            timer.start()
        return True

    def _again(self, signum: int) -> None:
        self.pending = False
        signal.pthread_kill(threading.main_thread().ident, signum)


def importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` (or a caller of it) runs an ``import`` (its module's body, or the
    import system itself)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def finished_so_far(run_dir: Path) -> tuple[int, Path]:
    """How many requests the run directory's :data:`FINISHED` file holds, and its path."""
    path = run_dir / FINISHED
    return (len(path.read_text().splitlines()) if path.exists() else 0), path


def append_ranks_log(run_dir: Path, head: str, text: str) -> Path:
    """Append ``text`` under a ``--- head`` line to the run directory's :data:`RANKS_LOG`, in one
    write (another rank's entry does not cut into it); returns the log's path."""
    path = run_dir / RANKS_LOG
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"--- {head}\n{text}".encode())
    finally:
        os.close(fd)
    return path


def root_cause(failures: dict) -> tuple[int, object] | None:
    """``(rank, failure)`` of the failure that ended a job, of torch's per-rank ``ProcessFailure``s
    (``ChildFailedError.failures``, in the order its agent saw the ranks end): the earliest that is
    not a rank stopped afterwards (:data:`STOPPED`), the first seen on a tie (its timestamps are
    whole seconds); the earliest of all if every rank was stopped. None when there is none."""
    ended = list(failures.items())
    causes = [(rank, f) for rank, f in ended if f.exitcode not in STOPPED] or ended
    return min(causes, key=lambda item: item[1].timestamp) if causes else None


def failed(e: Exception, run_dir: Path) -> int:
    """The exit status of a job whose ranks failed (``e``: torch's ``ChildFailedError``): 2 when a
    rank reported a user error (its line is printed already), else 1 with a line naming the rank
    that failed first (:func:`root_cause`: not one stopped after it), how, and where the requests
    that finished before it are."""
    failures = getattr(e, "failures", {})
    if any(f.exitcode == EXIT_USER for f in failures.values()):
        return EXIT_USER
    rank, failure = root_cause(failures) or (None, None)
    code = None if failure is None else failure.exitcode
    how = f"killed by {signal_name(code)}" if code is not None and code < 0 else f"exit status {code}, see above"
    done, finished = finished_so_far(run_dir)
    kept = f"; {done} finished requests kept in {finished.resolve()}" if done else ""
    print(f"error: rank {rank} failed ({how}){kept}", file=sys.stderr, flush=True)
    return 1


def story_lines(summary: dict) -> list[str]:
    """What died and how the job came back, one line each: supervised deaths (``fault`` of a
    ``fault.migrate`` run) and whole-job restarts (torchrun's, each from scratch)."""
    lines, fault = [], summary.get("fault", {})
    for d in fault.get("deaths", []):
        how = "hung, killed" if d.get("hung") else signal_name(d.get("exitcode"))
        if not d.get("hung") and (d.get("exitcode") or 0) > 0:  # an exception ended it: its traceback is kept
            how += f", its traceback in {RANKS_LOG}"
        moved = _moved(d)
        back = (
            ""
            if d.get("rejoined_s") is None
            else f"; its group served again {d['rejoined_s'] - d['seen_s']:.1f} s later{_weights(fault, d)}"
        )
        lines.append(f"recovered: rank {d.get('rank')} died ({how}) at {d.get('died_s') or 0:.1f} s; {moved}{back}")
    if summary.get("failures", 0) and "fault" not in summary:
        lines.append(f"recovered: {summary['failures']} whole-job restart(s) after a rank failed, each from scratch")
    return lines


def _weights(fault: dict, death: dict) -> str:
    """`` with group 0's weights`` when the dead rank's next generation took them from a live replica."""
    if "endpoint" not in death:
        return ""
    generation = int(death["endpoint"].split(".")[1]) + 1
    source = fault.get("weights_from", {}).get(str(death.get("rank")), {}).get(str(generation))
    return f" with group {source[0].split('.')[0]}'s weights" if source and source[0] != "checkpoint" else ""


def _moved(death: dict) -> str:
    adopted, redone = len(death.get("adopted") or []), death.get("reprefilled_tokens") or 0
    again = sum(a[-1] for a in death.get("adopted") or [])
    if adopted:
        own = (death.get("adopted_by") or "").split(".")[0] == death.get("endpoint", "").split(".")[0]
        by = "its group's next generation (its supervisors kept their KV)" if own else "another group"
        return f"{adopted} request(s) adopted with their KV by {by}, {again} token(s) computed again"
    if redone:
        return f"{len(death.get('resumed') or [])} request(s) prefilled again on live groups ({redone} tokens)"
    return f"{len(death.get('resumed') or [])} request(s) waited for its respawn"


def signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exit status {code}"
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
