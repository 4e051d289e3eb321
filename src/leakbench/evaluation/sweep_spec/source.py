"""Reading a sweep spec: YAML text with the line of every field, and messages that name the line and the fix.

:func:`read_spec` parses a path, YAML text or a mapping (refusing duplicate keys, alias bombs and
non-UTF-8 files) and returns the data with a :class:`Source`, which maps every field path to its YAML
line: ``Source.where(("attacks", 1, "name"))`` is ``"spec.yaml line 7, field attacks[1].name"``.
:func:`pydantic_message` turns one pydantic error into that field path and a message saying the fix.
Used by :mod:`.spec` (the schema) and :mod:`.specnames` (the registry checks).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

import yaml
from pydantic import BaseModel

from ...errors import ConfigError
from .check import check_size, read_text

__all__ = ["Source", "dotted", "line_map", "read_spec", "pydantic_message"]


class Source:
    """Where a spec came from and the YAML line of every field path."""

    def __init__(self, name: str, lines: dict[tuple, int]) -> None:
        self.name, self.lines = name, lines

    def where(self, path: tuple) -> str:
        """``"spec.yaml line 7, field attacks[1].name"`` (the nearest enclosing line when the field is absent)."""
        line = None
        for cut in range(len(path), -1, -1):
            if path[:cut] in self.lines:
                line = self.lines[path[:cut]]
                break
        at = f"{self.name} line {line}" if line is not None else self.name
        return f"{at}, field {dotted(path)}" if path else at


def dotted(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def line_map(node: yaml.Node, path: tuple, out: dict[tuple, int], source: str) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                raise ConfigError(f"{source} line {key_node.start_mark.line + 1}, field {dotted(path + (key,))}: "
                                  f"duplicate key {key!r}; keep one of them")
            seen.add(key)
            out[path + (key,)] = key_node.start_mark.line + 1
            line_map(value_node, path + (key,), out, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            line_map(item, path + (i,), out, source)


#: deepest nesting of mappings and lists a spec may have (a real one has fewer than ten levels).
MAX_DEPTH = 64


def check_depth(text: str, name: str) -> None:
    """Refuse YAML nested deeper than :data:`MAX_DEPTH` from the parser's events (iterative: no recursion)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise ConfigError(f"{name} line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep; a sweep "
                                  "spec is a few levels of mappings and lists — flatten it")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def check_nesting(value: Any, name: str) -> None:
    """Refuse mappings and lists nested deeper than :data:`MAX_DEPTH` (walked with a stack: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (Mapping, list, tuple)):
            if depth > MAX_DEPTH:
                raise ConfigError(f"{name}: nested more than {MAX_DEPTH} levels deep; a sweep spec is a few levels "
                                  "of mappings and lists — flatten it")
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)


def read_spec(source: str | Path | Mapping) -> tuple[Any, Source]:
    if isinstance(source, Mapping):
        check_nesting(source, "spec")
        return dict(source), Source("spec", {})
    if isinstance(source, BaseModel):
        return source.model_dump(), Source("spec", {})
    path = Path(source) if isinstance(source, Path) or ("\n" not in str(source) and
                                                         str(source).endswith((".yaml", ".yml"))) else None
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"expected a sweep spec file, got {str(path)!r} (no such file)")
        text, name = read_text(path), path.name
    else:
        text, name = str(source), "spec"
    try:
        check_depth(text, name)
        node = yaml.compose(text)
        check_size(node, name)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{name}{where}: not valid YAML ({problem}); check indentation and quoting") from None
    lines: dict[tuple, int] = {}
    if node is not None:
        line_map(node, (), lines, name)
    return data, Source(name, lines)


_FIXES = {
    "extra_forbidden": "remove it or fix its spelling; known fields: {known}",
    "missing": "add it",
    "too_short": "give at least one entry",
}


def pydantic_message(err: Mapping[str, Any], root: type[BaseModel]) -> tuple[tuple, str]:
    """The field path of one pydantic error and a message that says the fix (``root``: the spec's model)."""
    path = tuple(p for p in err["loc"] if not (isinstance(p, str) and p[:1].isupper()))  # drop model-name tags
    msg = err["msg"].removeprefix("Value error, ")
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _owner_model(path[:-1], root)
        known = ", ".join(owner.model_fields) if owner is not None else "see docs/evaluation.md"
        return path, f"unknown field {path[-1]!r}; " + _FIXES[kind].format(known=known)
    if kind == "missing":
        return path, f"missing required field {path[-1]!r}; {_FIXES[kind]}"
    if kind in _FIXES:
        return path, f"{msg.lower()}; {_FIXES[kind]}"
    if "input" in err and kind not in ("value_error",):
        return path, f"{msg.lower()}, got {err['input']!r}"
    return path, msg


def _owner_model(path: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model describing the mapping at ``path`` below ``root`` (for listing its fields)."""
    model: Any = root
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        for _ in range(3):  # unwrap Optional[...] and list[...]
            args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                break
            annotation = args[0] if args else annotation
        model = annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None
