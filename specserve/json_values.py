"""Equality of JSON values as a request means them: `1`, `1.0` and `true` are three values.

Python's `==` says `True == 1 == 1.0`; a field whose only accepted value is `false` or `0` must not
take `0` or `false` for it. Shared by the chat template's message fields and the gateway's
neutral OpenAI fields.
"""

from __future__ import annotations

from collections.abc import Iterable


def one_of(value, values: Iterable) -> bool:
    """Whether `value` is one of `values`, by identity or by equal value of the same type."""
    return any(value is v or (type(value) is type(v) and value == v) for v in values)
