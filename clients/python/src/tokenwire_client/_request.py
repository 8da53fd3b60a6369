"""Turns `generate(inputs, **parameters)` keyword arguments into the generated request message.

Shared by both clients so that they accept exactly the same parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._generated.google.protobuf import Value
from ._generated.tokenwire.v1 import GenerateParameters, GenerateRequest, Grammar

PARAMETER_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(GenerateParameters))


def _grammar(value: Grammar | Mapping[str, Any]) -> Grammar:
    if isinstance(value, Grammar):
        return value
    if not isinstance(value, Mapping) or set(value) - {"type", "value"}:
        raise TypeError('grammar must be a Grammar or a {"type": ..., "value": ...} mapping')
    # `value` is any JSON value: a schema object for "json", a pattern string for "regex".
    return Grammar(type=str(value.get("type", "")), value=Value.from_dict(value.get("value")))


def build_request(inputs: str, parameters: Mapping[str, Any]) -> GenerateRequest:
    """Returns the GenerateRequest for a prompt and TGI-style parameters.

    Raises TypeError for a parameter name that GenerateParameters does not have; values are
    checked by the server, which answers INVALID_ARGUMENT (ValidationError) naming the field.
    """
    if not isinstance(inputs, str):
        raise TypeError(f"inputs must be a str, not {type(inputs).__name__}")
    unknown = sorted(set(parameters) - PARAMETER_NAMES)
    if unknown:
        raise TypeError(
            f"unknown generation parameter(s): {', '.join(unknown)}; "
            f"expected some of: {', '.join(sorted(PARAMETER_NAMES))}"
        )
    fields = dict(parameters)
    if fields.get("grammar") is not None:
        fields["grammar"] = _grammar(fields["grammar"])
    if fields.get("stop") is not None:
        fields["stop"] = list(fields["stop"])
    fields = {name: value for name, value in fields.items() if value is not None}
    return GenerateRequest(inputs=inputs, parameters=GenerateParameters(**fields))


def auth_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries the API key, as the router expects it."""
    return [] if api_key is None else [("authorization", f"Bearer {api_key}")]
