"""Load YAML into a pydantic model with errors that name file:line, the field and what is allowed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from kvroute.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class ConfigFileError(ConfigError):
    """Unreadable or invalid YAML configuration; the message names file:line and the field."""


class AtItem(ConfigError):
    """Raised by a validator whose error belongs below its field (``loc``, e.g. a list index), so
    that the message names that item's line rather than the field's."""


def first_repeat(names: Iterable[str]) -> tuple[int, int] | None:
    """(index of the first name seen before, index where it was first seen), or None when all differ:
    for validators that point at the repeated list item's line (raise :class:`AtItem` there)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            return i, seen[name]
        seen[name] = i
    return None


def unique_items(names: Iterable[str], what: str, section: str) -> None:
    """Raise :class:`AtItem` at the second of two equal names: ``{what} must be unique; repeated:
    NAME (as in {section}[i])``."""
    names = list(names)
    hit = first_repeat(names)
    if hit is not None:
        i, first = hit
        raise AtItem(f"{what} must be unique; repeated: {names[i]} (as in {section}[{first}])", (i,))


def line_of(text: str, loc: tuple) -> int | None:
    """Line of the YAML node at ``loc`` (mapping keys and list indices)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model that owns the last key of ``loc``."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        ann = field.annotation
        for cand in (*getattr(ann, "__args__", ()), ann):
            inner = getattr(cand, "__args__", ())
            for c in (cand, *inner):
                if isinstance(c, type) and issubclass(c, BaseModel):
                    model = c
                    break
            else:
                continue
            break
    return list(model.model_fields)


def validate(model: type[M], data: Any, source: str, text: str | None = None) -> M:
    """Validate parsed YAML against ``model``; errors name source:line, the field and the allowed values."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{source}: expected a mapping of keys, got {type(data).__name__}")
    try:
        return model(**data)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            loc = tuple(e["loc"])
            item = (e.get("ctx") or {}).get("error")
            if isinstance(item, AtItem):
                loc += item.loc
            where = ".".join(str(x) for x in loc)
            line = line_of(text, loc) if text else None
            at = f"{source}:{line}" if line else source
            if e["type"] == "extra_forbidden":
                msgs.append(f"{at}: unknown key {where!r}; allowed: {', '.join(allowed_keys(model, loc))}")
            else:
                msg = e["msg"].removeprefix("Value error, ")
                if not loc:  # a check across fields: its message names them; the input is the whole file
                    msgs.append(f"{at}: {msg}")
                    continue
                got = "" if isinstance(item, AtItem) else f" (got {e.get('input')!r})"
                msgs.append(f"{at}: {where}: {msg}{got}")
        raise ConfigFileError("\n".join(msgs)) from None


def read(path: str | Path) -> tuple[Any, str]:
    """Parsed YAML and its text; unreadable files and syntax errors name file:line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigFileError(f"{path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text), text
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigFileError(f"{p}:{mark.line + 1 if mark else '?'}: invalid YAML: "
                              f"{getattr(exc, 'problem', exc)}") from None


def load(model: type[M], path: str | Path) -> M:
    """Read and validate a YAML file into ``model``."""
    data, text = read(path)
    return validate(model, data, str(path), text)


def read_secret(env: str | None, file: str | None, owner: str = "") -> str:
    """A secret from the environment variable ``env`` or else from ``file`` (surrounding whitespace
    dropped), so that keys and tokens never sit in the YAML; unset, unreadable or empty is a
    ValueError naming the source, after ``owner`` (e.g. ``"peer_auth: "``)."""
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ValueError(f"{owner}environment variable {env} is unset or empty")
        return value
    try:
        value = Path(str(file)).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{owner}cannot read {file}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"{owner}{file} is empty")
    return value
