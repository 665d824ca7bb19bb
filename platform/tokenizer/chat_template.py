"""Rendering a model's chat template exactly as transformers' `apply_chat_template` does.

The template is untrusted Jinja from the model file, so it runs in jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the `loopcontrols` extension,
and transformers' additions: `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter that
does not HTML-escape, and a `{% generation %}` block tag (rendered as its body; we never need
the assistant mask it exists for). Variables: `messages`, `tools`, `documents`,
`add_generation_prompt`, the special token strings (`bos_token`, `eos_token`, ...) and any
extra keyword arguments, which win over the special tokens as in transformers.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.platform.errors import ConfigError, InvalidRequestError


def validate_messages(messages: object) -> list[dict]:
    """Copies of the messages, or InvalidRequestError naming the first thing wrong.

    A conversation is a non-empty list of dicts, each with a non-empty string "role" and a
    string "content"; other keys (name, tool_calls, ...) pass through to the template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of dicts, got {_describe(messages)}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"messages[{index}] must be a dict with 'role' and 'content', got {_describe(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}]['role'] must be a non-empty string, got {_describe(role)}")
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{index}]['content'] must be a string, got {_describe(content)}")
    return [dict(message) for message in messages]


def render_chat_template(
    source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str], **kwargs
) -> str:
    """The template's text for `messages` (already validated). A `raise_exception` in the
    template (e.g. "roles must alternate") is the caller's mistake: InvalidRequestError."""
    variables = {"tools": None, "documents": None, **special_tokens, **kwargs}
    try:
        return compile_chat_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"the chat template rejected the conversation: {exc}") from exc


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template (cached per source); a syntax error is the model's: ConfigError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the model's chat template does not parse: {exc} (line {exc.lineno})") from exc


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
