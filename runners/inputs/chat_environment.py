"""The Jinja environment chat templates are rendered in: the one transformers renders them in, rebuilt with jinja2.

A chat template is a Jinja program shipped with a checkpoint (untrusted: anyone can publish one), written
against what ``transformers`` gives it in ``apply_chat_template`` (transformers 5.24,
``utils/chat_template_utils.py``).  elx's runtime has no transformers, so this module sets up the same
environment, so that a template renders here to the very characters it renders to there:

* an immutable sandbox (``jinja2.sandbox.ImmutableSandboxedEnvironment``): a template can neither reach
  Python internals nor change the lists and dicts it is given;
* ``trim_blocks`` and ``lstrip_blocks``: the newline after a block tag and the blanks before one are not
  output (templates are laid out on several lines and rely on it);
* the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and the ``{% generation %}`` ...
  ``{% endgeneration %}`` block, which transformers uses to mark the assistant's tokens and which renders
  its body unchanged;
* ``raise_exception(message)``, by which templates refuse conversations (roles out of order, an unsupported
  role): it raises ``jinja2.TemplateError(message)``, as transformers does, and elx turns it into an
  ``ElxError`` carrying the template's message (``runners/inputs/chat.py``);
* the ``tojson`` filter as ``json.dumps`` with ``ensure_ascii=False`` (Jinja's own escapes ``<``, ``>``, ``&``
  and ``'`` for HTML, and would change tool schemas in the prompt), taking ``indent``, ``separators`` and
  ``sort_keys``;
* ``strftime_now(format)``: the local time now, formatted (templates that state today's date);
* ``dict`` (build a dict, ``dict.fromkeys``) and ``namespace`` (Jinja's, refusing attribute names that begin
  with ``_``, the way into an object's internals).

Compiled templates are cached by their text (an export's template is compiled once per process).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

_OLDEST_SAFE_JINJA = (3, 1, 6)  # earlier releases have known sandbox escapes (transformers refuses them too)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates pass it by
    return datetime.now().strftime(format)


class _DictBuilder:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without handing it the ``dict`` type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args) -> dict:
        return dict.fromkeys(*args)


def _public_name(name) -> None:
    from jinja2.exceptions import SecurityError

    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a chat template may not set the attribute {name!r} on a namespace (names beginning "
                            "with '_' are refused)")


@lru_cache(maxsize=None)
def _namespace_type():
    from jinja2.utils import Namespace

    class SafeNamespace(Namespace):
        def __init__(*args, **kwargs):  # Jinja's own signature: a namespace may hold an attribute named 'self'
            target, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                _public_name(name)
            Namespace.__init__(target, attributes)

        def __setitem__(self, name, value):
            _public_name(name)
            Namespace.__setitem__(self, name, value)

    return SafeNamespace


@lru_cache(maxsize=None)
def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from elx.runners.errors import ElxError

    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < _OLDEST_SAFE_JINJA:
        raise ElxError(f"chat templates need jinja2 >= {'.'.join(map(str, _OLDEST_SAFE_JINJA))} (this is "
                       f"{jinja2.__version__}, which has known sandbox escapes); upgrade it: pip install -U jinja2")

    class GenerationBlock(Extension):
        """``{% generation %}BODY{% endgeneration %}`` renders as BODY."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictBuilder(),
                               namespace=_namespace_type())
    return environment


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled ``jinja2.Template`` of ``source`` (raises ``jinja2.TemplateSyntaxError`` on a broken one)."""
    return _environment().from_string(source)
