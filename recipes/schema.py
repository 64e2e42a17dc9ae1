"""Hydra's view of the configs: the schemas in Hydra's ``ConfigStore``, composition, conversion to
the dataclasses, and Hydra/OmegaConf errors as one line naming the key.

Each job's dataclass is stored as ``<job>_schema`` (``conf/<job>.yaml`` lists it first in its
defaults and so is checked against it); each registered strategy's dataclass as the option
``<name>_schema`` of the ``parallel`` group (``conf/parallel/<name>.yaml`` extends it; a
strategy without a YAML is also stored as ``parallel/<name>``). Hydra then refuses unknown keys
and values of the wrong type itself, naming the key; the dataclasses' ``__post_init__`` checks
ranges and choices. Only this package sees OmegaConf: the library gets the dataclasses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from types import MappingProxyType
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reshard.parallel.engine import Strategy, registered, strategy_class
from reshard.recipes.config import GenerateConfig
from reshard.recipes.plan_config import PlanConfig
from reshard.recipes.rollout_config import RolloutJobConfig

CONFIG_MODULE = "reshard.conf"
BLOCK_SIZE_RESOLVER = "reshard.default_kv_block_size"  # conf/generate.yaml's engine.kv_block_size
JOBS = MappingProxyType({"generate": GenerateConfig, "rollout": RolloutJobConfig, "plan": PlanConfig})
# lines of an OmegaConf/Hydra message that are not the reason
_NOT_REASON = ("full_key:", "object_type=", "reference_type=", "To append", "Error merging override")


def register(overrides: Sequence[str] = ()) -> None:
    """Store the job schemas and every registered strategy's (a strategy named by its dotted
    module path in a ``parallel=`` override is imported, and so registered, first); register the
    resolvers the YAMLs name."""
    OmegaConf.register_new_resolver(BLOCK_SIZE_RESOLVER, _default_kv_block_size, replace=True)
    store = ConfigStore.instance()
    for name, cls in JOBS.items():
        store.store(name=f"{name}_schema", node=cls)
    for override in overrides:
        if override.startswith("parallel=") and "." in override:
            with contextlib.suppress(ValueError):  # not a strategy: Hydra reports the missing option
                strategy_class(override.split("=", 1)[1])
    for name in registered():
        cls = strategy_class(name)
        store.store(group="parallel", name=f"{name}_schema", node=cls)
        if not resources.files(CONFIG_MODULE).joinpath("parallel", f"{name}.yaml").is_file():
            store.store(group="parallel", name=name, node=cls)


def _default_kv_block_size(*, _root_: DictConfig) -> int | None:
    """``engine.kv_block_size`` left unset: the job's strategy's default (a paged cache where its
    engine caches prefixes, ``Strategy.default_kv_block_size``), contiguous slots with
    ``engine.kv_swap``. An override, ``null`` included, replaces it."""
    if _root_.engine.kv_swap:
        return None
    try:
        strategy = to_dataclass(_root_.parallel, prefix="parallel.")
    except ValueError:  # (a bad parallel section: its own conversion names the key)
        return None
    return strategy.default_kv_block_size()


def compose(job: str, overrides: Sequence[str] = ()) -> Any:
    """The dataclass of ``conf/<job>.yaml`` with ``overrides`` (Hydra's compose API, no run dir);
    ``ValueError`` (one line naming the key) for a bad config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    register(overrides)
    try:
        with initialize_config_module(CONFIG_MODULE, version_base=None):
            cfg = hydra_compose(job, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(one_line(e, overrides_given(overrides))) from None
    return to_dataclass(cfg)


def to_dataclass(cfg: DictConfig, prefix: str = "") -> Any:
    """The dataclass behind a composed config (``OmegaConf.to_object``); ``ValueError`` (one line
    naming the key) for a key that Hydra's ``+key=value`` added to a schema, or a bad value."""
    _refuse_added_keys(cfg, prefix)
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(one_line(e, prefix=prefix)) from None


def strategy_config(values: Mapping[str, Any]) -> Strategy:
    """The config of ``values["strategy"]`` (default ``tp``) from plain values, checked against its
    dataclass as a YAML would be (nested sections as mappings; errors name ``parallel.<key>``)."""
    values = dict(values)
    cls = strategy_class(values.pop("strategy", "tp"))
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls), values)
    except OmegaConfBaseException as e:
        raise ValueError(one_line(e, _flat(values), prefix="parallel.")) from None
    return to_dataclass(node, prefix="parallel.")


def _refuse_added_keys(node: DictConfig, path: str = "") -> None:
    """Hydra's ``+key=value`` adds a key even to a schema (``to_object`` would then set it as a
    stray attribute): refuse it, named as OmegaConf names a key it refuses."""
    cls = OmegaConf.get_type(node)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    for key, value in node.items():
        if names is not None and key not in names:
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ValueError(f"{path}{key}: Key '{key}' not in '{cls.__name__}' (given {value!r})")
        if isinstance(value, DictConfig):
            _refuse_added_keys(value, f"{path}{key}.")


def one_line(e: Exception, given: Mapping[str, Any] | None = None, prefix: str = "") -> str:
    """``key: reason`` from a Hydra/OmegaConf error, the key in full (``prefix`` + OmegaConf's) and
    the value from ``given`` (full key -> value as given) added when the reason does not show it; a
    missing group option lists the available ones."""
    if isinstance(e, MissingConfigException) and e.options and e.missing_cfg_file:
        group, _, value = e.missing_cfg_file.rpartition("/")
        options = sorted(o for o in e.options if not o.endswith("_schema"))
        return f"{group}: {value!r} is not one of {options}"
    key, reason = _key_and_reason(e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e)
    value = (given or {}).get(key)
    if value is not None and f"'{value}'" not in reason:
        reason += f" (given {value!r})"
    key = f"{prefix}{key}".rstrip(".")
    return f"{key}: {reason}" if key else reason


def _key_and_reason(e: Exception) -> tuple[str, str]:
    """The full key an OmegaConf error names and the first line of its reason (no type names)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    key = getattr(e, "full_key", None) or next((ln[10:] for ln in lines if ln.startswith("full_key: ")), "")
    reason = next((ln for ln in lines if not ln.startswith(_NOT_REASON) and "raised while composing" not in ln), "")
    return key, re.sub(r" of type '\w+'", "", reason or lines[0])


def overrides_given(overrides: Sequence[str]) -> dict[str, str]:
    """Hydra overrides (``[+~]key=value``) as full key -> value text."""
    return {o.lstrip("+~").split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}


def _flat(values: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Nested mappings as full key -> value."""
    flat = {}
    for key, value in values.items():
        flat.update(_flat(value, f"{path}{key}.") if isinstance(value, Mapping) else {f"{path}{key}": value})
    return flat
