"""Triton's JSON form of a model configuration (``GET /v2/models/{m}/config``) and the
repository API's ``config`` override parsed back from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from pdserve.config.schema import OVERRIDE_PATH, ConfigError, ModelConfig

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def config_to_json(cfg: ModelConfig) -> dict[str, object]:
    """Triton's JSON form of a configuration (``GET /v2/models/{m}/config``).

    Protobuf's JSON mapping with field names as in the ``.proto`` and fields
    without presence printed even when default (Triton's
    ``always_print_primitive_fields``); enums stay names (``"TYPE_FP32"``).
    Protobuf writes 64-bit integers as strings; Triton turns them back into
    numbers (``"dims": [64]``), and so does this, by walking the message
    descriptor alongside the dict.
    """
    try:
        d = json_format.MessageToDict(
            cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf < 5.26
        d = json_format.MessageToDict(
            cfg, preserving_proto_field_name=True, including_default_value_fields=True
        )
    _fix_int64(d, cfg.DESCRIPTOR)
    return d


def _fix_int64(d: dict[str, Any], desc: Descriptor) -> None:
    """Turn protobuf-JSON's string-encoded 64-bit integers in ``d`` back into ints."""
    for field in desc.fields:
        if field.name not in d:
            continue
        value = d[field.name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = field.message_type
            if sub.GetOptions().map_entry:
                value_field = sub.fields_by_name["value"]
                for key, item in value.items():
                    value[key] = _fix_value(item, value_field)
            elif _is_repeated(field):
                for item in value:
                    if isinstance(item, dict):
                        _fix_int64(item, sub)
            elif isinstance(value, dict):
                _fix_int64(value, sub)
        elif field.type in _INT64_TYPES:
            d[field.name] = [int(v) for v in value] if _is_repeated(field) else int(value)


def _fix_value(value: object, field: FieldDescriptor) -> object:
    """Fix one map value (a message dict or a scalar)."""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if isinstance(value, dict):
            _fix_int64(value, field.message_type)
        return value
    if field.type in _INT64_TYPES and isinstance(value, str | int | float):
        return int(value)
    return value


def _is_repeated(field: FieldDescriptor) -> bool:
    """Whether a field is repeated, without protobuf 6's deprecated ``label``."""
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is None:  # older protobuf
        return field.label == FieldDescriptor.LABEL_REPEATED
    return bool(is_repeated() if callable(is_repeated) else is_repeated)


def config_from_json(d: object, path: str | Path = OVERRIDE_PATH) -> ModelConfig:
    """Parse a JSON configuration (the repository API's ``config`` override).

    Accepts what :func:`config_to_json` produces (numbers or strings for 64-bit
    integers, enum names).

    Raises:
        ConfigError: not a JSON object, unknown fields, values of the wrong type, or
            nested too deeply.
    """
    if not isinstance(d, dict):
        raise ConfigError(
            path, "config", f"must be a JSON object (a ModelConfig), not {_json_kind(d)}"
        )
    cfg = ModelConfig()
    try:
        json_format.ParseDict(d, cfg)
    except json_format.ParseError as exc:
        raise ConfigError(path, "config", str(exc)) from None
    except RecursionError:
        raise ConfigError(path, "config", "nested too deeply") from None
    return cfg


def parse_config_override(
    value: str | bytes | dict[str, object] | ModelConfig | None,
) -> ModelConfig | None:
    """The repository API's ``config`` load parameter as a ``ModelConfig``.

    Args:
        value: Triton's JSON form as text (HTTP and gRPC send a string) or already
            parsed, or a ``ModelConfig`` (returned as is); None: no override.

    Returns:
        The configuration, or None when there is no override.

    Raises:
        ConfigError (path :data:`OVERRIDE_PATH`, field ``config``): the text is empty
            or blank (Triton cannot parse it either; leave the parameter out instead),
            not UTF-8, not JSON, nested too deeply, not a JSON object, or not a
            ModelConfig.
    """
    if value is None or getattr(value, "DESCRIPTOR", None) is ModelConfig.DESCRIPTOR:
        return value
    if isinstance(value, bytes | bytearray):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(OVERRIDE_PATH, "config", "not UTF-8 text") from None
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(
                OVERRIDE_PATH,
                "config",
                "empty: give the model configuration as a JSON object, "
                "or leave the 'config' parameter out",
            )
        try:
            value = json.loads(value)
        except RecursionError:
            raise ConfigError(OVERRIDE_PATH, "config", "nested too deeply") from None
        except ValueError as exc:
            raise ConfigError(OVERRIDE_PATH, "config", f"not JSON: {exc}") from None
    return config_from_json(value)


def _json_kind(value: object) -> str:
    """What a JSON value is, in JSON's words (``a JSON array``...)."""
    if isinstance(value, bool):
        return "a JSON boolean"
    if value is None:
        return "JSON null"
    if isinstance(value, int | float):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, list):
        return "a JSON array"
    return type(value).__name__
