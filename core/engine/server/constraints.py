"""Structured output on the HTTP routes: the request's one constraint (OpenAI's
response_format, SGLang's json_schema / regex / ebnf, vLLM's guided_*), compiled on a worker
thread before the request is queued, so that a malformed or unsupported one is a 400 naming
its field and the grammar backend's message."""

from __future__ import annotations

import asyncio
import json

from engine.engine import RequestError
from engine.interfaces import Constraint, GrammarError
from engine.server.errors import bad_request

# request field -> constraint kind (a dict given for a JSON schema is sent as its JSON text)
_FIELDS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
           "guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "ebnf"}


def _spec(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def body_constraint(body, prefix: str = "") -> Constraint | None:
    """The one constraint ``body`` asks for (None: unconstrained); two are a 400 naming both.
    ``prefix``: where the fields sit ("sampling_params." for /generate)."""
    found = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint("json_object", "", "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object: "
                              '{"name": ..., "schema": {...}}', param="response_format.json_schema",
                              code="invalid_value")
        found.append(Constraint("json_schema", json.dumps(fmt.json_schema.schema_),
                                "response_format.json_schema.schema"))
    for name, kind in _FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(Constraint(kind, _spec(value), prefix + name))
    if len(found) > 1:
        raise bad_request(f"{found[0].field} and {found[1].field} both constrain the output: "
                          f"give at most one", param=found[1].field, code="invalid_value")
    return found[0] if found else None


async def compile_first(st, constraint: Constraint | None) -> None:
    """Compile ``constraint`` (through the engine's cache, on a worker thread) before queueing:
    a 400 naming the field when it cannot be enforced; the engine's request then finds it
    compiled."""
    if constraint is None:
        return
    engine = st.runtime.engine
    try:
        engine.check_constraint(constraint)
        await asyncio.wrap_future(engine.grammar.submit(constraint))
    except RequestError as e:  # structured outputs are off: it says why
        raise bad_request(str(e), param=constraint.field, code="invalid_value") from None
    except GrammarError as e:
        raise bad_request(f"invalid {constraint.field} (grammar backend '{engine.grammar.name}'): "
                          f"{e}", param=constraint.field, code="invalid_value") from None
