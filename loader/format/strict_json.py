"""JSON from files gdsload does not trust: parsed with bounds, rejected the way the ``safetensors`` library rejects it.

Python's ``json`` accepts more than the Rust parser the ``safetensors`` library uses (``serde_json``): ``NaN``
and ``Infinity`` literals, lone UTF-16 surrogate escapes (``"\\ud800"``), ``-0`` where a size is expected, and
nesting as deep as the interpreter's recursion limit. :func:`loads` refuses the first three with the caller's
error type, keeps nesting under :data:`MAX_DEPTH` (serde_json stops at 128) and turns every parser failure
(recursion, integers too long to convert) into that error too. :func:`brief` quotes a value in a message
without walking all of it.

>>> loads(b'{"a": [1, 2]}', ValueError, "'x.json'")
{'a': [1, 2]}
>>> loads(b'{"a": NaN}', ValueError, "'x.json'")
Traceback (most recent call last):
ValueError: 'x.json' holds the literal NaN, which JSON does not allow (the safetensors library rejects it)
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_DEPTH", "DuplicateKey", "loads", "check_value", "brief", "NEG_ZERO"]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (``serde_json``, which ``safetensors`` parses with, allows 128)."""

NEG_ZERO = -0.0
"""What ``-0`` parses to: not an integer, so a size field holding it is refused (as ``safetensors`` refuses it),
while a field nobody reads may hold it."""

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlist, _BRIEF.maxdict = 3, 60, 60, 6, 6


def brief(value: Any) -> str:
    """A short ``repr`` of ``value`` for a message: nested containers and long strings are cut, in bounded work."""
    try:
        return _BRIEF.repr(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__}>"


class DuplicateKey(Exception):
    """A key appears twice in one object (``args[0]`` is the key)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


class _Constant(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _Constant(name)


def _int(text: str) -> Any:
    return NEG_ZERO if text == "-0" else int(text)


def loads(
    raw: bytes | str,
    error: Callable[[str], Exception],
    where: str,
    *,
    duplicates: bool = False,
    max_depth: int | None = MAX_DEPTH,
    strings: bool = True,
    invalid: str = "is not valid JSON",
) -> Any:
    """Parse ``raw`` (UTF-8 bytes or text) strictly; any failure raises ``error(message)``, the message starting
    with ``where`` (the file and the field).

    Refused: invalid UTF-8 or JSON, ``NaN``/``Infinity`` literals, lone surrogate escapes, nesting deeper than
    ``max_depth``, repeated keys in one object (unless ``duplicates``). ``-0`` parses to :data:`NEG_ZERO`. A caller
    that checks the strings and the nesting of what it reads itself passes ``strings=False`` and ``max_depth=None``
    (the parser's own recursion bound still holds). ``invalid`` words the message of text that does not parse.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    except UnicodeDecodeError as e:
        raise error(f"{where} {invalid} (not UTF-8: {e})") from None
    kwargs: dict[str, Any] = {"parse_constant": _reject_constant}
    if not duplicates:
        kwargs["object_pairs_hook"] = _no_duplicates
    if "-0" in text:  # only then: a hook on every integer costs time on large headers
        kwargs["parse_int"] = _int
    try:
        doc = json.loads(text, **kwargs)
    except DuplicateKey as e:
        raise error(f"{where}: key {brief(e.args[0])} appears twice in one object; keys must be unique") from None
    except _Constant as e:
        raise error(
            f"{where} holds the literal {e.args[0]}, which JSON does not allow (the safetensors library rejects it)"
        ) from None
    except RecursionError:
        raise error(f"{where} {invalid} (nested too deeply to parse)") from None
    except json.JSONDecodeError as e:
        raise error(f"{where} {invalid} ({e})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise error(f"{where} {invalid} ({str(e)[:200]})") from None
    surrogates = strings and "\\u" in text  # without escapes, valid UTF-8 holds no lone surrogate
    if max_depth is not None or surrogates:
        check_value(doc, error, where, max_depth=max_depth or 1 << 62, surrogates=surrogates)
    return doc


def check_value(
    value: Any,
    error: Callable[[str], Exception],
    where: str,
    *,
    max_depth: int = MAX_DEPTH,
    depth: int = 1,
    surrogates: bool = True,
) -> None:
    """Raise ``error`` if ``value`` (parsed JSON) nests deeper than ``max_depth`` (``value`` itself at ``depth``)
    or, with ``surrogates``, holds a string or key with a lone surrogate. Iterative: any depth is safe to walk."""
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, str):
            if surrogates:
                _check_text(v, error, where)
            continue
        if isinstance(v, (dict, list)):
            if d > max_depth:
                raise error(
                    f"{where} nests arrays and objects more than {max_depth} levels deep; nothing gdsload "
                    "reads needs that (the file is damaged or hostile)"
                )
            if isinstance(v, dict):
                for k, item in v.items():
                    if surrogates:
                        _check_text(k, error, where)
                    stack.append((item, d + 1))
            else:
                stack.extend((item, d + 1) for item in v)


def _check_text(text: str, error: Callable[[str], Exception], where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(
            f"{where}: the string {brief(text)} holds a lone UTF-16 surrogate escape, which is not valid "
            "Unicode (the safetensors library rejects it)"
        ) from None
