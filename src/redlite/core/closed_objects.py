"""JSON schemas with closed objects, for constrained decoding (pure, torch-free).

A JSON schema allows keys beyond ``properties`` unless it says otherwise, so a grammar built
from it lets a small model go on inventing keys (``{"path": "a", "x": 1, "y": ...}``) until
``max_tokens``. xgrammar, vLLM's default structured-output backend, compiles schemas in its
documented ``strict_mode`` (on by default: "the generated grammar will not allow properties
and items that is not specified in the schema"); llguidance has no such option, so
:func:`close_objects` writes its object half into the schema (arrays are left as they are):
every object schema that lists
``properties`` and says nothing about other keys (no ``additionalProperties``,
``unevaluatedProperties`` or ``patternProperties``) gets ``additionalProperties: false``.
What the client wrote about extra keys is kept as written, and an object without
``properties`` (``{"type": "object"}``: any object) stays open, and so does one that needs
other keys (a ``required`` key not in ``properties``, a larger ``minProperties``).

Intersections are left alone, where closing would forbid the keys another part brings: a
schema with its own ``properties`` next to ``allOf`` / ``anyOf`` / ``oneOf`` / ``$ref`` is not
closed, nor are ``allOf`` members, nor ``anyOf`` / ``oneOf`` members of a schema with its own
``properties``; ``$defs`` / ``definitions`` are closed only when no schema with its own
``properties`` also has a ``$ref`` or ``allOf`` (one that could point at them).
"""

from __future__ import annotations

from typing import Any

#: keywords by which a schema says what happens to keys beyond ``properties``
OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
_COMBINERS = ("allOf", "anyOf", "oneOf", "$ref")
_SCHEMA_MAPS = ("properties", "patternProperties")
# subschemas that describe values of their own (not ``not``, ``if``/``then``/``else`` or
# ``dependentSchemas``, which are read against the same object as their parent)
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "contains",
                  "additionalItems", "unevaluatedItems")
_DEFS = ("$defs", "definitions")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas are closed (see module docstring); anything
    that is not a dict is returned as it is. The input is not changed."""
    if not isinstance(schema, dict):
        return schema
    return _close(schema, closable=True, defs=not _merges_refs(schema))


def _close(node: Any, closable: bool, defs: bool) -> Any:
    if isinstance(node, list):  # draft-4 tuple ``items``
        return [_close(item, True, defs) for item in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    own = isinstance(node.get("properties"), dict)
    combined = any(k in node for k in _COMBINERS)
    if closable and own and not combined and not any(k in node for k in OPEN_KEYWORDS) \
            and _needs_no_other_keys(node):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS + (_DEFS if defs else ()):
        if isinstance(node.get(key), dict):
            out[key] = {name: _close(sub, True, defs) for name, sub in node[key].items()}
    for key in _SCHEMA_VALUES:
        if key in node:
            out[key] = _close(node[key], True, defs)
    if isinstance(node.get("prefixItems"), list):
        out["prefixItems"] = [_close(sub, True, defs) for sub in node["prefixItems"]]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            out[key] = [_close(sub, not own, defs) for sub in node[key]]
    if isinstance(node.get("allOf"), list):
        out["allOf"] = [_close(sub, False, defs) for sub in node["allOf"]]
    return out


def _needs_no_other_keys(node: dict) -> bool:
    """Whether an object of ``node`` can do without keys beyond its ``properties``: every
    ``required`` key is listed there and ``minProperties`` asks for no more keys than that."""
    properties = node["properties"]
    required = node.get("required")
    if isinstance(required, list) and any(key not in properties for key in required):
        return False
    least = node.get("minProperties")
    return not isinstance(least, int) or least <= len(properties)


def _merges_refs(node: Any) -> bool:
    """Whether some schema in ``node`` has its own ``properties`` and a ``$ref`` or ``allOf``."""
    if isinstance(node, list):
        return any(_merges_refs(item) for item in node)
    if not isinstance(node, dict):
        return False
    if isinstance(node.get("properties"), dict) and ("$ref" in node or "allOf" in node):
        return True
    return any(_merges_refs(value) for value in node.values() if isinstance(value, (dict, list)))
