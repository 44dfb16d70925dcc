"""OTLP/HTTP trace payloads (protobuf or JSON) to store spans.

Any OpenTelemetry SDK, in any language, can export into the store this way. A span names its
rollout attempt with the attributes `lightning.rollout_id` and `lightning.attempt_id`, on the span
itself or on its resource (one process per attempt can set them once there).

Decoding is CPU work the server does in a worker thread (store/server.py), and each export
carries at most `max_spans` spans, counted before any is decoded: the per-span work runs in
Python, 35 us a span (150k tiny spans: 5 s). Parsing itself is C that holds the GIL, bounded by
the body's size: 4-6 ms a MB of protobuf (upb), 25 ms a MB of JSON (orjson).
"""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from typing import Any

import orjson
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from pydantic import ValidationError

from lightning_core import semconv
from lightning_core.errors import InvalidInput, PayloadTooLarge
from lightning_core.store.schema import check_json_depth
from lightning_core.types import Span

# OTLP's SpanKind and StatusCode enums, by number.
_KINDS = {0: "internal", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {0: "unset", 1: "ok", 2: "error"}
_KIND_NAMES = {f"SPAN_KIND_{v.upper()}": v for v in set(_KINDS.values())}
_STATUS_NAMES = {f"STATUS_CODE_{v.upper()}": v for v in _STATUS.values()}

# Protobuf responses: an empty ExportTraceServiceResponse serialises to no bytes at all.
EMPTY_PROTOBUF_RESPONSE = b""


def decompress(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """The body under its Content-Encoding (gzip, deflate or none), at most `max_bytes` of it."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise InvalidInput(f"unsupported Content-Encoding {encoding!r}; use gzip or none")
    try:
        d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = d.decompress(body, max_bytes + 1)
    except (zlib.error, gzip.BadGzipFile) as exc:
        raise InvalidInput(f"body is not valid {encoding}: {exc}") from None
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"decompressed body over the limit of {max_bytes} bytes")
    return out


def _proto_value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_proto_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _proto_value(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, which)


def _proto_attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _proto_value(kv.value) for kv in kvs}


def _ids(attrs: dict[str, Any], resource: dict[str, Any], where: str) -> tuple[str, str]:
    rollout_id = attrs.get(semconv.ROLLOUT_ID) or resource.get(semconv.ROLLOUT_ID)
    attempt_id = attrs.get(semconv.ATTEMPT_ID) or resource.get(semconv.ATTEMPT_ID)
    if not rollout_id or not attempt_id:
        raise InvalidInput(
            f"{where} has no rollout attempt: set the attributes {semconv.ROLLOUT_ID!r} and "
            f"{semconv.ATTEMPT_ID!r} on the span or on its resource"
        )
    return str(rollout_id), str(attempt_id)


def _span(fields: dict[str, Any], where: str) -> Span:
    try:
        return Span.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput(f"{where} is not a valid span: {exc}") from None


def _check_count(count: int, max_spans: int) -> None:
    if count > max_spans:
        raise PayloadTooLarge(
            f"OTLP export of {count} spans, over the limit of {max_spans} a request: export "
            "in smaller batches (the batch exporter's max_export_batch_size), or raise "
            "LIGHTNING_MAX_OTLP_SPANS"
        )


def decode_protobuf(body: bytes, max_spans: int) -> list[Span]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise InvalidInput(f"malformed OTLP protobuf: {exc}") from None
    _check_count(
        sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans), max_spans
    )
    spans = []
    for resource_spans in request.resource_spans:
        resource = _proto_attrs(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                where = f"span {s.name!r} ({s.span_id.hex()})"
                attrs = _proto_attrs(s.attributes)
                rollout_id, attempt_id = _ids(attrs, resource, where)
                fields = {
                    "rollout_id": rollout_id,
                    "attempt_id": attempt_id,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_id": s.parent_span_id.hex() or None,
                    "name": s.name,
                    "kind": _KINDS.get(s.kind, "internal"),
                    "start_time": s.start_time_unix_nano / 1e9,
                    "end_time": s.end_time_unix_nano / 1e9 if s.end_time_unix_nano else None,
                    "status_code": _STATUS.get(s.status.code, "unset"),
                    "status_message": s.status.message or None,
                    "attributes": attrs,
                    "events": [
                        {
                            "name": e.name,
                            "timestamp": e.time_unix_nano / 1e9,
                            "attributes": _proto_attrs(e.attributes),
                        }
                        for e in s.events
                    ],
                    "resource": resource,
                }
                spans.append(_span(fields, where))
    return spans


def _json_value(v: dict[str, Any]) -> Any:
    if not isinstance(v, dict) or not v:
        return None
    key, value = next(iter(v.items()))
    if key == "intValue":
        return int(value)  # OTLP/JSON writes 64-bit integers as strings
    if key == "doubleValue":
        return float(value)
    if key == "arrayValue":
        return [_json_value(x) for x in value.get("values", [])]
    if key == "kvlistValue":
        return _json_attrs(value.get("values", []))
    return value  # stringValue, boolValue, bytesValue (already base64)


def _json_attrs(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _json_value(kv.get("value", {})) for kv in kvs}


def _json_enum(value: Any, by_number: dict[int, str], by_name: dict[str, str]) -> str:
    if isinstance(value, str):
        return by_name.get(value, "unset" if by_name is _STATUS_NAMES else "internal")
    return by_number.get(int(value or 0), "unset" if by_number is _STATUS else "internal")


def decode_json(body: bytes, max_spans: int) -> list[Span]:
    try:
        request = orjson.loads(body)
        # Checked here, not by the routes' JSON parsing: this endpoint reads its body raw.
        check_json_depth(request)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"malformed OTLP JSON: {exc}") from None
    spans = []
    try:
        _check_count(
            sum(
                len(ss.get("spans", []))
                for rs in request.get("resourceSpans", [])
                for ss in rs.get("scopeSpans", [])
            ),
            max_spans,
        )
        for resource_spans in request.get("resourceSpans", []):
            resource = _json_attrs(resource_spans.get("resource", {}).get("attributes", []))
            for scope_spans in resource_spans.get("scopeSpans", []):
                for s in scope_spans.get("spans", []):
                    where = f"span {s.get('name')!r} ({s.get('spanId')})"
                    attrs = _json_attrs(s.get("attributes", []))
                    rollout_id, attempt_id = _ids(attrs, resource, where)
                    status = s.get("status", {})
                    end = int(s.get("endTimeUnixNano", 0))
                    fields = {
                        "rollout_id": rollout_id,
                        "attempt_id": attempt_id,
                        "trace_id": s["traceId"],
                        "span_id": s["spanId"],
                        "parent_id": s.get("parentSpanId") or None,
                        "name": s["name"],
                        "kind": _json_enum(s.get("kind"), _KINDS, _KIND_NAMES),
                        "start_time": int(s["startTimeUnixNano"]) / 1e9,
                        "end_time": end / 1e9 if end else None,
                        "status_code": _json_enum(status.get("code"), _STATUS, _STATUS_NAMES),
                        "status_message": status.get("message") or None,
                        "attributes": attrs,
                        "events": [
                            {
                                "name": e["name"],
                                "timestamp": int(e["timeUnixNano"]) / 1e9,
                                "attributes": _json_attrs(e.get("attributes", [])),
                            }
                            for e in s.get("events", [])
                        ],
                        "resource": resource,
                    }
                    spans.append(_span(fields, where))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidInput(
            f"OTLP JSON does not have the ExportTraceServiceRequest shape: {exc!r}"
        ) from None
    return spans
