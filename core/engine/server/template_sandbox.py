"""The Jinja sandbox chat templates render in: the environment transformers'
``apply_chat_template`` builds (an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks,
loopcontrols, ``{% generation %}``, the ``tojson`` filter and the ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace`` globals), checking the running render's budget
(server/template_budget.py) as it renders.

A pure-Python render in a thread cannot be killed, so the sandbox checks the clock at every
call, attribute or item lookup, operator, filter and loop iteration (Jinja loops are rewritten
to iterate through a checking filter, so that an empty nested loop is bounded too), the size of
every value a call or an operator makes (and, before it makes it, of the ones whose size is
known beforehand: ``s * n``, ``s.replace``, ``s.center``, ``join``...)."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.server.template_budget import checked, current, size_of, tick

_CHECK_EVERY = 64  # loop iterations between two looks at the clock
_FORMAT_NUMBER = re.compile(r"\d+")


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
            checked(value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        checked(value)
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
        return checked(dict(*args, **kwargs))

    def fromkeys(self, *args, **kwargs):
        return checked(dict.fromkeys(*args, **kwargs))


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    b = current()
    if b is not None and isinstance(indent, int) and indent > 64:
        b.too_big(b.max_chars + 1, f"tojson with an indent of {indent}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _bounded_iter(iterable):
    """What every ``{% for %}`` iterates through: looks at the clock every few items."""
    b = current()
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
        return 2 * size_of(value)
    return 0


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def filtered(*args, **kwargs):
        b = current()
        if b is not None:
            b.time_up()
            # the filtered value comes after a context / eval context / environment, if any
            plain = [a for a in args if not isinstance(
                a, (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment))]
            b.too_big(_filter_precheck(name, plain, kwargs), f"the {name} filter's result")
        result = fn(*args, **kwargs)
        return checked(result, f"the {name} filter's result")
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
        b = current()
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
                b.too_big(size_of(left) + size_of(right) if type(left) is type(right) and
                          not isinstance(left, int) else 0, "a sum")
            elif operator == "%":
                b.too_big(_format_size(left) + size_of(left), "a formatted string")
        return checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        b = current()
        if b is not None:
            b.time_up()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                b.too_big(_expected_str_call(owner, getattr(__obj, "__name__", ""), args,
                                             kwargs), "a string")
            for a in (*args, *kwargs.values()):
                b.too_big(size_of(a), "an argument")
        return checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        b = current()
        if b is not None:
            b.time_up()
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                # the sandbox hands out its own wrapper of these: size them here
                b.too_big(_format_size(obj) + len(obj), "a formatted string")
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        tick()
        return super().getitem(obj, argument)
