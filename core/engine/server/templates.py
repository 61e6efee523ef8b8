"""Chat templates, rendered on a tokenizer thread (never the engine thread), in a Jinja sandbox
that bounds the time and the size of a render (server/template_sandbox.py, under a
server/template_budget.py budget).

The model's own template is always used; a template sent with a request (``chat_template``, as
a field or inside ``chat_template_kwargs``) is refused unless the server was started with
``--trust-request-chat-template`` (vLLM's flag; vLLM fixed the same hole, GHSA-6fvq-23cw-5628).
Of ``chat_template_kwargs`` only the variables the template refers to are passed (as vLLM does:
``jinja2.meta.find_undeclared_variables``); the others are dropped with a warning.

A render over its budget (time, or the characters rendered) raises ``ChatTemplateError`` naming
the limit (``limit`` is "time" or "size"), which the chat route turns into a 400. Renders get
the variables transformers' ``apply_chat_template`` gives (the messages, the request's
``tools`` (None without), ``documents`` None, ``add_generation_prompt``, the tokenizer's
special tokens, then the kwargs), so the model's template renders what it renders there.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import jinja2
import jinja2.meta

from engine.server.template_budget import Budget, ChatTemplateError, in_force
from engine.server.template_sandbox import BoundedSandbox

logger = logging.getLogger("engine.server")

RENDER_TIMEOUT_S = 5.0  # seconds one render may take
# characters one render may produce: its messages' own characters plus this many per token of
# the context (a prompt that renders longer cannot fit the context anyway), and at least...
CHARS_PER_CONTEXT_TOKEN = 16
MIN_MAX_CHARS = 1 << 20
MAX_TEMPLATE_CHARS = 256 << 10  # a request's own template (the model's are ~1-40 KB)
# variables every render gets (not taken from chat_template_kwargs)
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                      "chat_template"})


class ChatTemplates:
    """The server's chat templates: the tokenizer's own, and (trusted only) a request's."""

    def __init__(self, tokenizer, trust_request_template: bool = False,
                 context_length: int | None = None):
        self.tokenizer = tokenizer
        self.trust_request_template = trust_request_template
        self.context_length = context_length
        self.env = BoundedSandbox()
        self._compiled: OrderedDict[str, tuple] = OrderedDict()  # source -> (template, vars)
        self._lock = threading.Lock()

    @property
    def default(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def check_request(self, template: str | None, kwargs: dict | None) -> None:
        """Refuse a request's own template unless the server trusts them (before any work)."""
        given = [f for f, v in (("chat_template", template),
                                ("chat_template_kwargs.chat_template",
                                 (kwargs or {}).get("chat_template"))) if v is not None]
        if given and not self.trust_request_template:
            raise ChatTemplateError(
                f"{given[0]}: this server does not render chat templates sent with a request "
                f"(only its model's own); start it with --trust-request-chat-template to allow "
                f"them", param=given[0])

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               template: str | None = None, kwargs: dict | None = None,
               timeout_s: float | None = None, max_chars: int | None = None,
               tools: list[dict] | None = None) -> str:
        """The prompt text; ChatTemplateError (a 400) when the template cannot render it or
        goes over its time or size budget. ``tools``: the request's (OpenAI's form, which is
        transformers' ``tools=``)."""
        kwargs = dict(kwargs or {})
        template = template if template is not None else kwargs.pop("chat_template", None)
        kwargs.pop("chat_template", None)
        self.check_request(template, None)
        param = "chat_template" if template is not None else "messages"
        source = template if template is not None else self.default
        if not source:
            raise ChatTemplateError("this model's tokenizer has no chat template; use "
                                    "/v1/completions with a prompt instead")
        if template is not None and len(template) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat_template: longer than {MAX_TEMPLATE_CHARS} "
                                    f"characters", param="chat_template")
        budget = Budget(RENDER_TIMEOUT_S if timeout_s is None else timeout_s,
                         max_chars if max_chars is not None else self._max_chars(messages))
        compiled, variables = self._compile(source, param, budget)
        dropped = sorted(k for k in kwargs if k not in variables or k in RESERVED)
        if dropped:
            logger.warning(f"chat_template_kwargs: dropped {', '.join(dropped)} (the chat "
                           f"template does not use them)")
        context = {"messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt,
                   **self._special_tokens(),
                   **{k: v for k, v in kwargs.items() if k not in dropped}}
        parts, size = [], 0
        with in_force(budget):
            try:
                for chunk in compiled.generate(**context):
                    size += len(chunk)
                    budget.too_big(size, "the prompt")
                    budget.time_up()
                    parts.append(chunk)
            except ChatTemplateError as e:
                e.param = param
                raise
            except RecursionError:
                raise ChatTemplateError("the chat template recursed too deeply", param=param,
                                        limit="time") from None
            except MemoryError:
                raise ChatTemplateError("the chat template ran out of memory", param=param,
                                        limit="size") from None
            except Exception as e:  # noqa: BLE001 - templates raise anything (jinja, TypeError)
                raise ChatTemplateError(f"the chat template could not render these messages: "
                                        f"{e}", param=param) from None
        return "".join(parts)

    def _max_chars(self, messages: list[dict]) -> int:
        own = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
                  for m in messages)
        per_context = CHARS_PER_CONTEXT_TOKEN * (self.context_length or 0)
        return own + max(MIN_MAX_CHARS, per_context)

    def _special_tokens(self) -> dict:
        tokens = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return {k: v for k, v in tokens.items() if isinstance(k, str)}

    def _compile(self, source: str, param: str, budget: Budget):
        with self._lock:
            hit = self._compiled.get(source)
            if hit is not None:
                self._compiled.move_to_end(source)
                return hit
        # compiling evaluates the constant parts of the template (jinja writes them as text):
        # under the budget too, else a constant filter call would run unchecked
        with in_force(budget):
            try:
                tree = self.env.parse(source)
                variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
                compiled = self.env.from_string(tree)
            except ChatTemplateError as e:
                e.param = param
                raise
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the chat template does not parse: {e}",
                                        param=param) from None
            except Exception as e:  # noqa: BLE001 - anything jinja raises at compile time
                raise ChatTemplateError(f"the chat template does not compile: {e}",
                                        param=param) from None
        with self._lock:
            self._compiled[source] = (compiled, variables)
            while len(self._compiled) > 32:
                self._compiled.popitem(last=False)
        return compiled, variables
