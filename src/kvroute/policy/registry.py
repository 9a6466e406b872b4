"""Preset registry and configuration: build a policy by name with constant overrides.

A policy config, in YAML or as a dict::

    preset: sglang_cache_aware
    params: {cache_threshold: 0.6, admission: pending}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvroute import yamlconf
from kvroute.policy.base import Policy
from kvroute.policy.presets.aibrix import AIBrixPrefixCache
from kvroute.policy.presets.basic import LeastLoad, LeastRequest, PowerOfTwo, RandomPolicy, RoundRobin
from kvroute.policy.presets.dynamo import DynamoKV
from kvroute.policy.presets.gorgo import Gorgo
from kvroute.policy.presets.gorgo_tuned import GorgoTuned
from kvroute.policy.presets.hashing import ConsistentHash, PrefixHash
from kvroute.policy.presets.llm_d import LLMD
from kvroute.policy.presets.lmetric import LMetric
from kvroute.policy.presets.sglang import SGLangCacheAware
from kvroute.policy.presets.skywalker import SkyWalker, SkyWalkerCH
from kvroute.policy.presets.vllm import BailianLinear, VLLMJoinShortestQueue
from kvroute.policy.presets.weighted import Weighted

PRESETS: dict[str, type[Policy]] = {cls.name: cls for cls in (
    RoundRobin, RandomPolicy, LeastRequest, LeastLoad, PowerOfTwo,
    ConsistentHash, PrefixHash, SGLangCacheAware, AIBrixPrefixCache,
    VLLMJoinShortestQueue, BailianLinear, DynamoKV, LLMD, Weighted,
    SkyWalker, SkyWalkerCH, Gorgo, GorgoTuned, LMetric,
)}


class ConfigError(ValueError):
    """Invalid policy configuration; the message names the field and the allowed values."""


def _format_validation(preset: str, cls: type[Policy], err: ValidationError) -> str:
    valid = ", ".join(cls.Params.model_fields)
    lines = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "params"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown parameter {field!r}; valid parameters: {valid}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"parameter {field!r}: {msg} (got {e.get('input')!r})")
    return f"preset {preset!r}: " + "; ".join(lines)


def build_policy(preset: str, params: dict[str, Any] | None = None, seed: int = 0) -> Policy:
    cls = PRESETS.get(preset)
    if cls is None:
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"preset {preset!r}: params must be a mapping, got {type(params).__name__}")
    try:
        parsed = cls.Params(**(params or {}))
    except ValidationError as err:
        raise ConfigError(_format_validation(preset, cls, err)) from None
    return cls(parsed, seed=seed)


def policy_from_config(config: dict[str, Any] | str, seed: int = 0, where: str = "policy") -> Policy:
    """Build from ``"name"`` or ``{preset: name, params: {...}}``."""
    if isinstance(config, str):
        return build_policy(config, seed=seed)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a preset name or a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - {"preset", "params"})
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: preset, params")
    if "preset" not in config:
        raise ConfigError(f"{where}: missing 'preset'; valid presets: {', '.join(PRESETS)}")
    return build_policy(config["preset"], config.get("params"), seed=seed)


def load_policy_file(path: str | Path, seed: int = 0) -> Policy:
    try:
        data, _ = yamlconf.read(path)
    except yamlconf.ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    return policy_from_config(data, seed=seed, where=str(path))


def _register_staged() -> None:
    """CascadeInfer's length stages and its Llumnix-like baseline (registered apart: the stage
    preset builds its inner preset through this registry)."""
    from kvroute.policy.presets.cascadeinfer import CascadeInfer
    from kvroute.policy.presets.llumnix import LlumnixLike

    PRESETS.update({cls.name: cls for cls in (CascadeInfer, LlumnixLike)})


_register_staged()
