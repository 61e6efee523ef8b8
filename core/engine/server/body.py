"""Reading a request body: a size limit, JSON, the declared model, warnings for unknown fields."""

from __future__ import annotations

import logging

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from engine.server.errors import APIError, bad_request

logger = logging.getLogger("engine.server")
# After the limit the rest is read and dropped (up to this much more), so that the client, which
# sends its whole body before reading the answer, sees the 413 rather than a reset connection.
DRAIN_FACTOR = 8


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body is larger than the limit of {limit} bytes "
                            f"(--max-request-bytes)", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit * DRAIN_FACTOR:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_big
    return b"".join(chunks)


async def read_model(request: Request, model: type[BaseModel], limit: int):
    """Parse and validate the body as ``model``; a 400 naming the first bad field otherwise."""
    raw = await read_body(request, limit)
    try:
        parsed = model.model_validate_json(raw or b"null")
    except ValidationError as e:
        raise validation_error(e) from None
    ignored = parsed.ignored_fields() + _nested_ignored(parsed)
    if ignored:
        # once per request, as vLLM does: the client may rely on something we do not do
        logger.warning(f"{request.url.path}: ignoring unknown field(s) "
                       f"{', '.join(repr(f) for f in ignored)}")
    return parsed


def _nested_ignored(parsed: BaseModel) -> list[str]:
    out = []
    for name in type(parsed).model_fields:
        value = getattr(parsed, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel) and hasattr(item, "ignored_fields"):
                out += [f"{name}.{f}" for f in item.ignored_fields()]
    return sorted(set(out))


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                           code="invalid_json")
    if not first["loc"] and first["type"] == "value_error":  # a check across fields
        return bad_request(str(first["ctx"]["error"]), code="invalid_value")
    if not first["loc"]:
        return bad_request(f"the body must be a JSON object ({first['msg']})", code="invalid_body")
    field, union = _field(first["loc"]), _union_prefix(first["loc"])
    # a union (prompt: str | list[str] | list[int] ...) reports one error per accepted form
    group = [err for err in errors if union and _union_prefix(err["loc"]) == union]
    if len(group) > 1:
        forms = "; ".join(f"as {_tags(err['loc'])}: {err['msg']}" for err in group)
        message = f"{_field(union)} matches none of its accepted forms ({forms})"
    else:
        got = first.get("input")
        got = "" if isinstance(got, (dict, list)) or got is None else f", got {got!r:.80}"
        message = f"{field}: {first['msg']}{got}"
    return bad_request(message, param=str(first["loc"][0]), code="invalid_value")


def _field(loc) -> str:
    return ".".join(str(p) for p in loc if not _is_type_tag(str(p)))


def _union_prefix(loc) -> tuple:
    for i, p in enumerate(loc):
        if _is_type_tag(str(p)):
            return tuple(loc[:i])
    return ()


def _tags(loc) -> str:
    tags = " ".join(str(p) for p in loc[len(_union_prefix(loc)):])
    return tags.replace("constrained-int", "int >= 0")


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "dict")
