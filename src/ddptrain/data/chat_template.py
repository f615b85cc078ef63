"""Chat templates rendered within bounds: a template is user code, and every rendering of it ends.

A template runs in jinja2's immutable sandbox (as transformers renders chat templates: no attribute
access to internals, no mutation, `range` of at most 100,000 items), and more:
- time: every block the template runs (each loop iteration, each macro call, each branch taken) first
  checks the caller's deadline; nested loops over large ranges stop at it (`RENDER_TIME_S` per record).
- size: the output is counted as it is produced and stops past `MAX_RENDERED_CHARS`; `*` and `**`
  refuse to build a value larger than that, and so does setting a `namespace()` attribute (the only
  state a template carries from one loop iteration to the next, so no value doubles in a loop).
Whatever a rendering raises (the sandbox's own refusals, `raise_exception(...)`, a RecursionError of a
macro calling itself) becomes TemplateFailed with a one-line reason.

Not bounded: a single filter or method call asked for a huge value at once (`'x'|center(10**10)`) still
tries to build it, and so does one expression adding up many bounded values (`a ~ a ~ a ~ ...`, as long as
the template is); the output limit refuses it once built, or MemoryError ends the rendering.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Node
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

RENDER_TIME_S = 5.0  # per record: every rendering of one record's conversation together
MAX_RENDERED_CHARS = 1 << 24  # per rendering, and per value built by an operator or held in a namespace

__all__ = ["MAX_RENDERED_CHARS", "RENDER_TIME_S", "TemplateFailed", "render_bounded"]


class TemplateFailed(Exception):
    """A rendering that failed or went past a bound; its message is one line."""


class _PastBound(Exception):
    """Raised inside a rendering that went past a bound (the message says which)."""


class _TickingCodeGenerator(CodeGenerator):
    """jinja2's code generator, with a call to `environment.tick()` at the start of every block."""

    def blockvisit(self, nodes: Iterable[Node], frame: Frame) -> None:
        """The block as jinja2 writes it, after a deadline check (loop bodies and macros are blocks)."""
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _too_large(what: str, unit: str = "items") -> _PastBound:
    return _PastBound(f"{what} would be larger than {MAX_RENDERED_CHARS:,} {unit}")


class _BoundedNamespace(Namespace):
    """`namespace()` whose attributes hold values of at most MAX_RENDERED_CHARS items."""

    def __setitem__(self, name: str, value: Any) -> None:
        if _size(value) > MAX_RENDERED_CHARS:
            raise _too_large(f"namespace attribute {name!r}")
        super().__setitem__(name, value)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a deadline per thread and size-checked `*` and `**`."""

    code_generator_class = _TickingCodeGenerator
    # Not `+`: templates join strings with it (ChatML 4 times a message), and intercepting it doubled the time
    # of a rendering; it and `~` add up values that are each bounded, a few times per expression.
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.deadline = threading.local()
        self.globals["namespace"] = _BoundedNamespace
        self.globals["raise_exception"] = _raise_exception

    def tick(self) -> None:
        """Called by the compiled template at the start of every block: _PastBound past the deadline."""
        if time.monotonic() > self.deadline.at:
            raise _PastBound(f"it ran past its limit of {RENDER_TIME_S:g} s per record")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        """`*` and `**` computed only when their result is at most MAX_RENDERED_CHARS items (bits for a power)."""
        if operator == "*":
            n, sized = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(n, int) and n * _size(sized) > MAX_RENDERED_CHARS:
                raise _too_large("a repetition")
            return left * right
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > MAX_RENDERED_CHARS:
                raise _too_large("a power", "bits")
        return left**right


def _raise_exception(message: str) -> None:
    raise TemplateFailed(f"the chat template refused the record: {message}")


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Template:
    """The template compiled once per process."""
    return _BoundedEnvironment().from_string(template)


def render_bounded(template: str, deadline: float, variables: dict[str, Any]) -> str:
    """The template rendered with variables, stopped at deadline (time.monotonic()) or past
    MAX_RENDERED_CHARS of output; TemplateFailed with a one-line reason when it fails or is stopped."""
    try:
        compiled = _compiled(template)
        env = compiled.environment
        assert isinstance(env, _BoundedEnvironment)
        env.deadline.at = deadline
        parts: list[str] = []
        size = 0
        for part in compiled.generate(**variables):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise _too_large("its output", "characters")
            parts.append(part)
    except TemplateFailed:
        raise
    except _PastBound as e:
        raise TemplateFailed(f"the chat template was stopped: {e}") from None
    except TemplateError as e:
        raise TemplateFailed(f"the chat template failed on it: {_one_line(str(e))}") from None
    except Exception as e:  # the template is user code: whatever it raises is its failure
        raise TemplateFailed(f"the chat template failed on it: {type(e).__name__}: {_one_line(str(e))}") from None
    return "".join(parts)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
