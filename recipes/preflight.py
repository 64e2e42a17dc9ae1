"""What ``reshard`` checks before any rank starts: the job's config composed and checked as the
ranks will check it (with "did you mean" for a key close to one the job has), the model path and
cache directory (a write tried, not permission bits), the RL task, and the request count; each a
``ValueError`` of one line naming the key. ``reshard <job> --keys`` prints :func:`keys_lines`."""

from __future__ import annotations

import dataclasses
import difflib
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def check(job: str, overrides: Sequence[str], nproc: int) -> Any:
    """The job's config dataclass, checked as the ranks will check it (layouts and kills against
    ``nproc`` ranks too); ``ValueError`` with one line naming the key otherwise."""
    from reshard.parallel.model.tiny_models import BUILTIN_NAME
    from reshard.recipes import schema
    from reshard.recipes.launch import collective_timeout
    from reshard.recipes.rollout_config import POLICY_NAME

    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a key=value override")
    collective_timeout()  # the environment's timeout, as every rank reads it
    try:
        cfg = schema.compose(job, overrides)
    except ValueError as e:
        raise ValueError(str(e) + did_you_mean(job, str(e), overrides)) from None
    if job in ("generate", "serve"):
        cfg.fault.check_world(nproc)
        cfg.parallel.layouts(nproc)
        _check_model_path(cfg.model.path)
        _check_cache_dir(cfg.model, BUILTIN_NAME)
    if job == "serve":
        from reshard.recipes.serve import check_http_packages

        check_http_packages()
    if job == "rollout":
        from reshard.parallel.strategies.rollout import RankSplit, rollout_dims, rollout_strategy

        r = cfg.rollout
        split = RankSplit.of(nproc, r.colocated, r.train_ranks)
        rollout_dims(rollout_strategy(r.layout, tp=r.tp, sp=r.sp), split.rollout)
        _check_task(cfg.train)
        _check_cache_dir(cfg.model, POLICY_NAME)
    return cfg


def _check_task(train) -> None:
    """A ``train.reward`` that does not import, prompts that are not there: refused here (the ranks tokenize)."""
    from reshard.recipes.rl_task import load_reward, load_rows

    if train.reward is not None:
        load_reward(train.reward)
    if train.prompts_file is not None and not Path(train.prompts_file).is_file():
        raise ValueError(f"train.prompts_file {train.prompts_file!r} is not a file")
    if train.prompts_dataset is not None:
        load_rows(train.prompts_dataset, train.prompts_split)


def _check_cache_dir(model: Any, name: str) -> None:
    """``ValueError`` for a ``model.cache_dir`` the ranks could not write when they must make the
    built-in checkpoint ``name`` there (no ``model.path``, not made yet); one they only read is fine."""
    from reshard.parallel.model.tiny_models import default_cache_dir

    if model.path is not None:
        return
    directory = (Path(model.cache_dir) if model.cache_dir else default_cache_dir()).expanduser()  # as the ranks read it
    if not (directory / name / "config.json").exists():
        what = f"model.cache_dir {model.cache_dir!r}" if model.cache_dir else f"the cache directory {str(directory)!r}"
        check_writable(what, directory)


def check_writable(what: str, directory: Path) -> None:
    """``ValueError`` naming ``what`` and the OS error unless a file can be made in ``directory``
    or, if it does not exist yet, in its nearest existing parent: the write tried (and removed),
    since permission bits say nothing for root, ACLs or a read-only mount."""
    existing = next(p for p in (directory, *directory.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{what} cannot be written ({str(existing)!r} is not a directory)")
    try:
        with tempfile.NamedTemporaryFile(prefix=".reshard-write-check-", dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{what} cannot be written ({str(existing)!r}: {e.strerror})") from None


def _check_model_path(path: str | None) -> None:
    """``ValueError`` for a ``model.path`` that names a local directory (``/``, ``.``, ``~``)
    which is not a checkpoint: missing, without ``config.json``, or one that is not JSON. (A hub
    id, ``org/name``, resolves on the ranks.)"""
    if path is None or not str(path).startswith(("/", ".", "~")):
        return
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"model.path {path!r} is not a directory (a checkpoint directory or a hub id org/name)")
    config = directory / "config.json"
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        raise ValueError(f"model.path {path!r} has no config.json: not an HF checkpoint directory") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path {path!r}: its config.json is not JSON ({e})") from None


def did_you_mean(job: str, message: str, overrides: Sequence[str]) -> str:
    """`` (did you mean 'engine.max_batch_size'?)`` when ``message`` refuses a key that is close to
    one the job has; else ``""``."""
    key = message.split(":", 1)[0]
    if "not in" not in message:
        return ""
    keys = all_keys(job, overrides)
    if "." not in key:  # a top-level name: the sections and keys at the top
        keys = sorted({k.split(".", 1)[0] for k in keys})
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def all_keys(job: str, overrides: Sequence[str]) -> list[str]:
    """Every full key of the job's config (with the ``parallel=`` strategy the overrides chose)."""
    return [k for k, _ in flat_defaults(job, overrides)]


def flat_defaults(job: str, overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """``(full key, default)`` of the job's config, depth first."""
    from reshard.recipes import schema

    groups = [o for o in overrides if o.split("=", 1)[0] == "parallel"]
    cfg = schema.compose(job, groups)

    def walk(node: Any, path: str) -> list[tuple[str, Any]]:
        if not dataclasses.is_dataclass(node):
            return [(path, node)]
        return [kv for f in dataclasses.fields(node) for kv in walk(getattr(node, f.name), f"{path}{f.name}.")]

    return [(k.rstrip("."), v) for k, v in walk(cfg, "")]


def keys_lines(job: str, overrides: Sequence[str]) -> list[str]:
    """One line per key: ``engine.max_batch_size = 8``."""
    return [f"{key} = {json.dumps(value, default=repr)}" for key, value in flat_defaults(job, overrides)]


def total_requests(cfg: Any) -> int | None:
    """How many requests a generate job runs (``None`` for jobs without requests); a prompts file
    that does not exist or is not UTF-8 is a ``ValueError`` naming it."""
    from reshard.recipes.prompts import _prompt_lines

    w = getattr(cfg, "workload", None)
    if w is None or not hasattr(w, "num_requests"):
        return None
    if w.prompts_file is None:
        return w.num_requests * cfg.generation.n
    path = Path(w.prompts_file)
    if path.is_dir():
        raise ValueError(f"workload.prompts_file {str(path)!r} is a directory; give a JSONL file")
    if not path.is_file():
        raise ValueError(f"workload.prompts_file {str(path)!r} does not exist")
    return len(_prompt_lines(path)) * cfg.generation.n
