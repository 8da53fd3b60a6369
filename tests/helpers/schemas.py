"""The structured-output schema suite, shared by tests/e2e/test_structured.py and
benchmarks/structured.py: JSON schemas with nested objects, arrays with minItems/maxItems, enums,
bounded numbers, string patterns and formats, optional properties and anyOf; every string is
bounded (maxLength, pattern, enum or a fixed-length format) so that a small model's output ends
within a few dozen tokens. Tool declarations for the tool-calling conversations too."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


# (name, what to ask for, schema)
SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "a person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120}})),
    ("color", "your favourite color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("city", "a city and its country", _obj({"city": _NAME, "country": _NAME})),
    ("nested_user", "a user account", _obj({
        "user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": _NAME}),
        "active": {"type": "boolean"},
    })),
    ("tags", "one to three tags for a blog post", _obj({
        "tags": {"type": "array", "items": {"enum": ["news", "tech", "sport", "food"]},
                 "minItems": 1, "maxItems": 3},
    })),
    ("weather", "today's weather", _obj({
        "temperature": {"type": "integer", "minimum": -50, "maximum": 50},
        "sky": {"enum": ["sunny", "cloudy", "rainy"]},
    })),
    ("product_code", "a product code", _obj({
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
    })),
    ("any_of", "a digit or the word none", _obj({
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                            {"enum": ["none"]}]},
    })),
    ("optional_props", "some settings (any of them)", _obj({
        "dark_mode": {"type": "boolean"},
        "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
        "language": {"enum": ["en", "fr", "de"]},
        "nickname": {"type": "string", "maxLength": 12},
    }, required=[])),
    ("points", "two points on a grid", _obj({
        "points": {"type": "array", "items": _obj({
            "x": {"type": "integer", "minimum": 0, "maximum": 99},
            "y": {"type": "integer", "minimum": 0, "maximum": 99},
        }), "minItems": 2, "maxItems": 2},
    })),
    ("date", "a date in 2024", _obj({"date": {"type": "string", "format": "date"}})),
    ("uuid", "an identifier", _obj({"id": {"type": "string", "format": "uuid"}})),
    ("deep", "a company with its address", _obj({
        "company": _obj({"name": _NAME, "address": _obj({
            "street": {"type": "string", "maxLength": 24},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        })}),
    })),
    ("exclusive", "a positive count below ten", _obj({
        "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    })),
    ("shape", "a circle or a square", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                       "maximum": 9}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}}),
    ]}})),
    ("rating", "a rating", _obj({"stars": {"enum": [1, 2, 3, 4, 5]}})),
    ("price", "a price", _obj({"amount": {"type": "number", "minimum": 0, "maximum": 1000},
                                "currency": {"enum": ["EUR", "USD"]}})),
    ("nullable", "a middle name or null", _obj({"middle_name": {"anyOf": [
        {"type": "string", "maxLength": 12}, {"type": "null"}]}})),
    ("refs", "a pet and its owner", {
        "$defs": {"named": _obj({"name": _NAME})},
        **_obj({"pet": {"$ref": "#/$defs/named"}, "owner": {"$ref": "#/$defs/named"}}),
    }),
    ("task", "a to-do item", _obj({
        "title": {"type": "string", "minLength": 3, "maxLength": 20},
        "done": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 3},
        "due": {"type": "string", "format": "date"},
    }, required=["title", "done"])),
    ("scores", "three test scores", _obj({
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 3, "maxItems": 3},
    })),
    ("flag", "a yes/no answer", _obj({"answer": {"type": "boolean"}})),
]

# The benchmark's mask-time schema: ten optional properties (the case that blows up regex-based
# JSON compilers).
TEN_OPTIONAL: dict[str, Any] = _obj(
    {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"type": "string"},
        "country": {"type": "string"},
        "notes": {"type": "string"},
    },
    required=[],
)

# (name, description, parameters schema) of the tool-calling conversations' functions.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": _obj({"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    }},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": _obj({"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}),
    }},
    {"type": "function", "function": {
        "name": "search_books", "description": "Finds books by an author",
        "parameters": _obj({"author": _NAME,
                            "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
                           required=["author"]),
    }},
]
