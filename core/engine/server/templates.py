"""Chat templates, rendered on a tokenizer thread (never the engine thread), in a Jinja sandbox
that bounds the time and the size of a render.

The model's own template is always used; a template sent with a request (``chat_template``, as
a field or inside ``chat_template_kwargs``) is refused unless the server was started with
``--trust-request-chat-template`` (vLLM's flag; vLLM fixed the same hole, GHSA-6fvq-23cw-5628).
Of ``chat_template_kwargs`` only the variables the template refers to are passed (as vLLM does:
``jinja2.meta.find_undeclared_variables``); the others are dropped with a warning.

A pure-Python render in a thread cannot be killed, so the sandbox checks its budget while it
renders: the clock at every call, attribute or item lookup, operator, filter and loop
iteration (Jinja loops are rewritten to iterate through a checking filter, so that an empty
nested loop is bounded too), the size of every value a call or an operator makes (and, before
it makes it, of the ones whose size is known beforehand: ``s * n``, ``s.replace``,
``s.center``, ``join``...), and the characters rendered. Over budget the render raises
``ChatTemplateError`` naming the limit (``limit`` is "time" or "size"), which the chat route
turns into a 400.

The environment is the one transformers' ``apply_chat_template`` builds (an
ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loopcontrols, ``{% generation
%}``, the ``tojson`` filter and the ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace`` globals) with the same variables (the messages, ``tools`` and ``documents``
None, ``add_generation_prompt``, the tokenizer's special tokens, then the kwargs), so the
model's template renders what it renders there.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
_CHECK_EVERY = 64  # loop iterations between two looks at the clock
_FORMAT_NUMBER = re.compile(r"\d+")


class ChatTemplateError(Exception):
    """A template that cannot be used or rendered: a 400 for the request. ``param``: the request
    field it is about; ``limit``: "time" or "size" when a render went over its budget."""

    def __init__(self, message: str, param: str = "messages", limit: str | None = None):
        super().__init__(message)
        self.param, self.limit = param, limit


class _Budget:
    __slots__ = ("deadline", "timeout_s", "max_chars", "ticks")

    def __init__(self, timeout_s: float, max_chars: int):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.deadline = time.monotonic() + timeout_s
        self.ticks = 0

    def time_up(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"the chat template took longer than {self.timeout_s:g} s to render; it was "
                f"stopped", limit="time")

    def too_big(self, n: int, what: str = "a value") -> None:
        if n > self.max_chars:
            raise ChatTemplateError(
                f"the chat template rendered more than {self.max_chars} characters, the limit "
                f"of one render ({what} would have {n}); it was stopped", limit="size")


_current = threading.local()  # the budget of the render running on this thread


def _budget() -> _Budget | None:
    return getattr(_current, "budget", None)


def _tick() -> None:
    b = _budget()
    if b is not None:
        b.time_up()


def _size(value) -> int:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3  # about its decimal digits
    return 0


def _check(value, what: str = "a value"):
    b = _budget()
    if b is not None:
        b.time_up()
        b.too_big(_size(value), what)
    return value


def _joined_size(items) -> int:
    if isinstance(items, (list, tuple)):
        return sum(len(x) if isinstance(x, str) else 8 for x in items)
    return 0


def _format_size(fmt) -> int:
    """The largest width or precision a %- or {}-format string asks for."""
    if not isinstance(fmt, str):
        return 0
    numbers = _FORMAT_NUMBER.findall(fmt)
    if any(len(n) > 18 for n in numbers):
        return 10 ** 18
    return max(map(int, numbers), default=0)


def _expected_str_call(obj, name: str, args, kwargs) -> int:
    """The size a str method's result will have, when it can be big and is known beforehand."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and \
            isinstance(args[1], str):
        hits = obj.count(args[0]) if args[0] else len(obj) + 1
        if len(args) >= 3 and isinstance(args[2], int) and args[2] >= 0:
            hits = min(hits, args[2])
        return len(obj) + hits * max(len(args[1]) - len(args[0]), 0)
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return args[0]
    if name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        return len(obj) + obj.count("\t") * max(size if isinstance(size, int) else 8, 0)
    if name == "join" and args:
        return _joined_size(args[0]) + len(obj) * max(len(args[0]) - 1, 0) \
            if isinstance(args[0], (list, tuple)) else 0
    if name in ("format", "format_map"):
        return _format_size(obj) + len(obj)
    return 0


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders
    its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore attributes; and every value stored is checked
    against the budget (a namespace is how a template carries a value across iterations)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check_name(name)
            _check(value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        _check(value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")


class _Dict:
    """transformers' ``dict`` global: a constructor, not the type."""

    def __call__(self, *args, **kwargs):
        return _check(dict(*args, **kwargs))

    def fromkeys(self, *args, **kwargs):
        return _check(dict.fromkeys(*args, **kwargs))


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    b = _budget()
    if b is not None and isinstance(indent, int) and indent > 64:
        b.too_big(b.max_chars + 1, f"tojson with an indent of {indent}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _bounded_iter(iterable):
    """What every ``{% for %}`` iterates through: looks at the clock every few items."""
    b = _budget()
    if b is None:
        yield from iterable
        return
    b.time_up()
    n = 0
    for item in iterable:
        n += 1
        if n % _CHECK_EVERY == 0:
            b.time_up()
        yield item


def _filter_precheck(name: str, args, kwargs) -> int:
    """The size a built-in filter's result will have, when it can be big and is known
    beforehand (args[0] is the filtered value)."""
    if not args:
        return 0
    value = args[0]
    if name == "replace" and len(args) >= 3 and isinstance(value, str):
        return _expected_str_call(value, "replace", (str(args[1]), str(args[2]),
                                                     *args[3:4]), {})
    if name == "center":
        width = args[1] if len(args) > 1 else kwargs.get("width", 80)
        return width if isinstance(width, int) else 0
    if name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        return len(value) + (value.count("\n") + 1) * max(width, 0)
    if name == "join":
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        if isinstance(value, (list, tuple)):
            return _joined_size(value) + len(str(sep)) * max(len(value) - 1, 0)
    if name == "format" and isinstance(value, str):
        return _format_size(value) + len(value)
    if name == "wordwrap":
        return 2 * _size(value)
    return 0


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def filtered(*args, **kwargs):
        b = _budget()
        if b is not None:
            b.time_up()
            # the filtered value comes after a context / eval context / environment, if any
            plain = [a for a in args if not isinstance(
                a, (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment))]
            b.too_big(_filter_precheck(name, plain, kwargs), f"the {name} filter's result")
        result = fn(*args, **kwargs)
        return _check(result, f"the {name} filter's result")
    return filtered


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox that checks the running render's budget (see the module doc)."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def __init__(self):
        # optimized=False: the optimizer folds constant expressions (a filter with constant
        # arguments) while compiling, outside any budget
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         extensions=[_Generation, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.filters["_bounded_iter"] = _bounded_iter
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _Dict()
        self.globals["namespace"] = _Namespace

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every loop looks at the clock as it iterates
            loop.iter = nodes.Filter(loop.iter, "_bounded_iter", [], [], None, None,
                                     lineno=loop.iter.lineno)
        return tree

    def call_binop(self, context, operator, left, right):
        b = _budget()
        if b is not None:
            b.time_up()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                        b.too_big(len(seq) * n, "a repeated value")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                    abs(left) > 1 and right > 0:
                b.too_big(right * abs(left).bit_length() // 3, "a power")
            elif operator == "+":
                b.too_big(_size(left) + _size(right) if type(left) is type(right) and
                          not isinstance(left, int) else 0, "a sum")
            elif operator == "%":
                b.too_big(_format_size(left) + _size(left), "a formatted string")
        return _check(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        b = _budget()
        if b is not None:
            b.time_up()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                b.too_big(_expected_str_call(owner, getattr(__obj, "__name__", ""), args,
                                             kwargs), "a string")
            for a in (*args, *kwargs.values()):
                b.too_big(_size(a), "an argument")
        return _check(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        b = _budget()
        if b is not None:
            b.time_up()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                # the sandbox hands out its own wrapper of these: size them here
                b.too_big(_format_size(obj) + len(obj), "a formatted string")
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)


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
               timeout_s: float | None = None, max_chars: int | None = None) -> str:
        """The prompt text; ChatTemplateError (a 400) when the template cannot render it or
        goes over its time or size budget."""
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
        budget = _Budget(RENDER_TIMEOUT_S if timeout_s is None else timeout_s,
                         max_chars if max_chars is not None else self._max_chars(messages))
        compiled, variables = self._compile(source, param, budget)
        dropped = sorted(k for k in kwargs if k not in variables or k in RESERVED)
        if dropped:
            logger.warning(f"chat_template_kwargs: dropped {', '.join(dropped)} (the chat "
                           f"template does not use them)")
        context = {"messages": messages, "tools": None, "documents": None,
                   "add_generation_prompt": add_generation_prompt,
                   **self._special_tokens(),
                   **{k: v for k, v in kwargs.items() if k not in dropped}}
        _current.budget = budget
        parts, size = [], 0
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
            raise ChatTemplateError(f"the chat template could not render these messages: {e}",
                                    param=param) from None
        finally:
            _current.budget = None
        return "".join(parts)

    def _max_chars(self, messages: list[dict]) -> int:
        own = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
                  for m in messages)
        per_context = CHARS_PER_CONTEXT_TOKEN * (self.context_length or 0)
        return own + max(MIN_MAX_CHARS, per_context)

    def _special_tokens(self) -> dict:
        tokens = getattr(self.tokenizer, "special_tokens_map", None) or {}
        return {k: v for k, v in tokens.items() if isinstance(k, str)}

    def _compile(self, source: str, param: str, budget: _Budget):
        with self._lock:
            hit = self._compiled.get(source)
            if hit is not None:
                self._compiled.move_to_end(source)
                return hit
        # compiling evaluates the constant parts of the template (jinja writes them as text):
        # under the budget too, else a constant filter call would run unchecked
        _current.budget = budget
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
        finally:
            _current.budget = None
        with self._lock:
            self._compiled[source] = (compiled, variables)
            while len(self._compiled) > 32:
                self._compiled.popitem(last=False)
        return compiled, variables
