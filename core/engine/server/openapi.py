"""/openapi.json, generated from the route table and the declared pydantic models, so that it
cannot drift from what the routes actually accept and return."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from engine.server.openai import ErrorResponse

_ERRORS = {"400": "Invalid request (bad JSON, wrong type, value out of range, prompt too long)",
           "401": "Missing or wrong API key", "404": "Unknown model",
           "413": "Request body over the size limit",
           "503": "Queue full, shutting down, or the engine is not ready"}


@dataclass
class Endpoint:
    path: str
    methods: tuple[str, ...]
    handler: Callable
    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    streams: bool = False  # may answer text/event-stream (when the body says "stream": true)
    media_type: str | None = None  # a non-JSON answer (the Prometheus text format)
    public: bool = False  # served without the API key
    errors: tuple[str, ...] = ()


def openapi_spec(endpoints: list[Endpoint], title: str, version: str, auth: bool) -> dict:
    models = [(m, "validation") for m in {e.request for e in endpoints if e.request}]
    models += [(m, "serialization") for m in
               {e.response for e in endpoints if e.response} | {ErrorResponse}]
    refs, defs = models_json_schema(sorted(models, key=lambda x: x[0].__name__),
                                    ref_template="#/components/schemas/{model}")
    paths: dict = {}
    for e in endpoints:
        for method in e.methods:
            paths.setdefault(e.path, {})[method.lower()] = _operation(e, method, refs, auth)
    spec = {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
    if auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec


def _operation(e: Endpoint, method: str, refs: dict, auth: bool) -> dict:
    ok: dict = {"description": "OK"}
    if e.media_type:
        ok["content"] = {e.media_type: {"schema": {"type": "string"}}}
    elif e.response:
        ok["content"] = {"application/json": {"schema": refs[(e.response, "serialization")]}}
    if e.streams:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    op = {"operationId": f"{e.handler.__name__}_{method.lower()}", "summary": e.summary,
          "responses": {"200": ok}}
    codes = list(e.errors)
    if e.request and method != "GET":
        op["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(e.request, "validation")]}}}
        codes += ["400", "413"]
    if auth and not e.public:
        codes.append("401")
    error = {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}
    for code in sorted(set(codes)):
        op["responses"][code] = {"description": _ERRORS[code], "content": error}
    if e.public:
        op["security"] = []
    return op
