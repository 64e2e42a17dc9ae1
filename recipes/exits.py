"""How a job ends, as the launcher and the ranks both say it (the standard library only: the
launcher reads this before it imports torch, so Ctrl-C at any moment is one line)."""

from __future__ import annotations

from pathlib import Path

LAUNCHED_ENV = "RESHARD_LAUNCHER"  # set for ranks started by the ``reshard`` command (recipes/cli.py)
EXIT_USER, EXIT_INTERRUPTED = 2, 130  # a user error; Ctrl-C (128 + SIGINT, as a shell reports it)
FINISHED = "finished.jsonl"  # each request, as it finishes, in the run directory (kept if the job dies)


def finished_so_far(run_dir: Path) -> tuple[int, Path]:
    """How many requests the run directory's :data:`FINISHED` file holds, and its path."""
    path = run_dir / FINISHED
    return (len(path.read_text().splitlines()) if path.exists() else 0), path
