"""Helpers a grammar backend may use: the constraint checks every backend needs before its own
compiler sees the text (so that a malformed schema or choice list gets the same message whatever
the backend), and the EOS token a constrained output ends with."""

from __future__ import annotations

import json

from engine.interfaces import Constraint, GrammarError

# constraint kind -> how an error message names it
LABELS = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex",
          "ebnf": "EBNF grammar", "choice": "choice list"}


def check_kind(constraint: Constraint) -> str:
    """The constraint's kind, refused when it is none of ``LABELS``."""
    if constraint.kind not in LABELS:
        raise GrammarError(f"unknown constraint kind '{constraint.kind}' (known: "
                           f"{', '.join(LABELS)})", constraint.field)
    return constraint.kind


def parse_choices(constraint: Constraint) -> list[str]:
    """A "choice" constraint's strings: its spec must be a non-empty JSON list of strings."""
    try:
        choices = json.loads(constraint.spec)
    except ValueError as e:
        raise GrammarError(f"choice list is not valid JSON: {e}", constraint.field) from None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) for c in choices)):
        raise GrammarError(f"choice list must be a non-empty JSON list of strings, got "
                           f"{constraint.spec[:80]}", constraint.field)
    return choices


def parse_schema(constraint: Constraint) -> str:
    """The schema text, refused here when it is not JSON (a backend's own message may quote the
    whole text back) or not a schema at all."""
    try:
        schema = json.loads(constraint.spec)
    except ValueError as e:
        raise GrammarError(f"JSON schema is not valid JSON: {e}", constraint.field) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"JSON schema must be a JSON object (or true/false), got "
                           f"{type(schema).__name__}", constraint.field)
    return constraint.spec


def eos_token_id(tokenizer, backend: str) -> int:
    """The tokenizer's EOS id, which ends every constrained output; a tokenizer without one is
    refused when grammar backend ``backend`` is built."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"grammar backend '{backend}' needs the tokenizer's EOS token to end a "
                         f"constrained output, and this tokenizer has none; pass --tokenizer "
                         f"with one that defines eos_token, or --grammar-backend none")
    return eos
