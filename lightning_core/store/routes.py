"""The store's routes, derived from its API table (api.py): one FastAPI route per endpoint, each
calling its store method and sending the result as orjson-encoded JSON."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError

from lightning_core.store import api
from lightning_core.store.base import NEXT_PAGE_HEADER, PAGE_SIZE
from lightning_core.store.schema import check_json_depth

# What the server does around one endpoint's store call, given the request and its parsed body:
# entered before the call (an error raised on entering refuses the request), left after it.
Wrapper = Callable[[Request, Any], AbstractAsyncContextManager[Any]]


class _OrjsonRequest(Request):
    """Request bodies parsed with orjson: twice as fast as the json module on 2 MB of spans.

    On the event loop, not in a thread: orjson holds the GIL for the whole parse (25 ms a MB;
    1.5 s for 62 MB), so a thread would stall the loop just as long. The body's size bounds it.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # orjson.JSONDecodeError subclasses json.JSONDecodeError, so FastAPI still answers
            # malformed JSON as such.
            value = orjson.loads(await self.body())
            check_json_depth(value)
            self._json = value
        return self._json


class OrjsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return orjson_handler


def json_response(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _answer(endpoint: api.Endpoint, result: Any) -> Response:
    if endpoint.paged:
        # A page: its items, or their JSON as the database worker wrote it (sent on without
        # parsing), and the cursor of the next page when one is left.
        items, following = result
        body = items if isinstance(items, bytes) else orjson.dumps(_jsonable(items))
        headers = {NEXT_PAGE_HEADER: following} if following is not None else None
        return Response(body, media_type="application/json", headers=headers)
    response = json_response(
        {endpoint.wrap: result} if endpoint.wrap is not None else _jsonable(result)
    )
    if endpoint.status_of is not None:
        response.status_code = endpoint.status_of(result)
    return response


# Items validated per slice: about 1 ms of the GIL for spans, so the event loop, waiting for it
# at most the interpreter's switch interval (5 ms) more, keeps answering /health meanwhile.
CHUNK_ITEMS = 256


def _validate_in_slices(model: type[BaseModel], name: str, raw: Any) -> BaseModel:
    """`model` from the parsed JSON `raw`, its list field `name` validated a slice at a time
    (run in a thread). Errors are the framework's, located as it would locate them."""
    items = raw.get(name) if isinstance(raw, dict) else None
    try:
        if not isinstance(items, list):
            return model.model_validate(raw)
        adapter = TypeAdapter(list[model.model_fields[name].annotation.__args__[0]])
        validated: list[Any] = []
        for start in range(0, len(items), CHUNK_ITEMS):
            try:
                validated += adapter.validate_python(items[start : start + CHUNK_ITEMS])
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                raise RequestValidationError(
                    [
                        {**e, "loc": ("body", name, start + e["loc"][0], *e["loc"][1:])}
                        for e in errors
                    ]
                ) from None
        # Its items are models already: not validated again.
        return model.model_validate({**raw, name: validated})
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def _slices_schema(model: type[BaseModel], name: str) -> dict[str, Any]:
    """The request body's OpenAPI entry for a chunked endpoint (whose handler reads the body
    itself): the model's list of items, named as the schema's components name them."""
    item = model.model_fields[name].annotation.__args__[0]
    schema = {
        "title": model.__name__,
        "type": "object",
        "required": [name],
        "properties": {
            name: {"type": "array", "items": {"$ref": f"#/components/schemas/{item.__name__}"}}
        },
    }
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _handler(endpoint: api.Endpoint, store: Any, wrapper: Wrapper | None) -> Callable[..., Any]:
    call = (
        getattr(store, endpoint.calls)
        if isinstance(endpoint.calls, str)
        else partial(endpoint.calls, store)
    )

    async def handle(request: Request, body: BaseModel | None = None, **path: str) -> Response:
        if endpoint.chunked is not None:
            # Parsed on the loop (orjson holds the GIL for the whole parse anyway), validated in
            # a thread a slice at a time.
            try:
                raw = await request.json()
            except json.JSONDecodeError as exc:
                # As the framework answers a body that is not JSON.
                error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode "
                         "error", "input": {}, "ctx": {"error": exc.msg}}  # fmt: skip
                raise RequestValidationError([error]) from None
            body = await asyncio.to_thread(
                _validate_in_slices, endpoint.body, endpoint.chunked, raw
            )
        arguments: dict[str, Any] = {}
        if body is not None:
            arguments = {endpoint.body_as: body} if endpoint.body_as else dict(body)
        if endpoint.paged and arguments.get("limit") is None:
            arguments["limit"] = PAGE_SIZE
        async with wrapper(request, body) if wrapper is not None else nullcontext():
            result = await call(*(path[name] for name in endpoint.path_params), **arguments)
        return _answer(endpoint, result)

    # What FastAPI reads the request into: the path's parameters, then the body (a GET's from
    # the query string).
    kind = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter("request", kind, annotation=Request)]
    parameters += [inspect.Parameter(name, kind, annotation=str) for name in endpoint.path_params]
    if endpoint.body is not None and endpoint.chunked is None:
        model = endpoint.body if endpoint.method == "POST" else Annotated[endpoint.body, Query()]
        parameters.append(inspect.Parameter("body", kind, annotation=model))
    handle.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return handle


def add_store_routes(app: FastAPI, store: Any, wrappers: Mapping[api.Endpoint, Wrapper]) -> None:
    """A route on `app` for every endpoint of the table, answered by `store` (a DuckDBStore),
    with `wrappers` around the store calls of some."""
    for endpoint in api.ENDPOINTS:
        app.add_api_route(
            endpoint.path,
            _handler(endpoint, store, wrappers.get(endpoint)),
            methods=[endpoint.method],
            name=endpoint.name,
            response_model=endpoint.response,
            summary=endpoint.summary,
            status_code=endpoint.status_code,
            responses=endpoint.responses,
            openapi_extra=_slices_schema(endpoint.body, endpoint.chunked)
            if endpoint.chunked is not None and endpoint.body is not None
            else None,
        )
