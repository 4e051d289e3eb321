"""The sweep spec as a reader wants it: plain YAML, with no escapes.

The store keeps the spec as ``yaml.safe_dump`` wrote it, which escapes every non-ASCII character
(``"\\u03B5"`` for ε) and folds long strings across lines with backslashes.  :func:`readable_yaml` loads it
and dumps it again with Unicode kept, no line folding and the keys in their order; text that is not YAML is
returned as it was.
"""
from __future__ import annotations

import yaml


class _Dumper(yaml.SafeDumper):
    """A safe dumper that writes multi-line strings as literal blocks (``|``) instead of escaped ``\\n``."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value.strip("\n") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def readable_yaml(text: str) -> str:
    """``text`` (a stored spec) re-dumped as readable YAML; unchanged when it does not parse."""
    if not text or not text.strip():
        return text
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(data, (dict, list)):
        return text
    return yaml.dump(data, Dumper=_Dumper, allow_unicode=True, sort_keys=False, width=10_000,
                     default_flow_style=False)


__all__ = ["readable_yaml"]
