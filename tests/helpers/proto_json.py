"""Protobuf messages as the JSON the public REST API speaks."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message


def to_json(message: Message) -> dict[str, Any]:
    """`message` printed with the options of Envoy's transcoder (proto field names, primitives
    always printed), parsed back into Python values."""
    return json.loads(
        json_format.MessageToJson(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )
