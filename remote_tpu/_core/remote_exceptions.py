"""A user's exception on the wire: described where it was raised, every part
cut to what a report can carry, and rebuilt as itself where it is shown.

Shared by the worker (which describes) and the client (which rebuilds).
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import cloudpickle

from .limits import (EXCEPTION_MESSAGE_CHARS, PICKLED_EXCEPTION_BYTES, TRACEBACK_CHARS,
                      cut_text, valid_text)


def _pickle_exception(exc: BaseException) -> bytes:
    """``exc`` pickled so that it loads again here (so it will there), or b""."""
    try:
        pickled = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)        # an exception that cannot round-trip here won't there
        return pickled
    except Exception:  # noqa: BLE001
        try:
            return cloudpickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001
            return b""


def _built_in_init(cls: type) -> bool:
    """Whether ``cls`` is built from its ``args`` alone (its __init__ is a
    built-in exception's), so that a copy with other args is the same kind."""
    owner = getattr(cls.__init__, "__objclass__", None)
    return owner is not None and owner.__module__ == "builtins"


def _smaller_arg(arg: Any, where: str) -> Any:
    if isinstance(arg, str):
        return cut_text(arg, EXCEPTION_MESSAGE_CHARS, where)
    try:
        small = len(pickle.dumps(arg, protocol=5)) <= EXCEPTION_MESSAGE_CHARS
    except Exception:  # noqa: BLE001
        small = False
    return arg if small else cut_text(repr(arg), EXCEPTION_MESSAGE_CHARS, where)


def _smaller_exception(exc: BaseException, where: str) -> bytes:
    """The same exception class with its large arguments cut (text) or
    replaced by their cut repr, pickled; b"" for a class with its own
    __init__, which a copy with other arguments would misrepresent."""
    cls = type(exc)
    if not _built_in_init(cls):
        return b""
    try:
        smaller = cls.__new__(cls)
        smaller.args = tuple(_smaller_arg(a, where) for a in exc.args)
        smaller.add_note("[remote_tpu: this exception was too large to send whole: its "
                         "large arguments were cut, or replaced by their cut repr]")
        pickled = pickle.dumps(smaller, protocol=5)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001
        return b""
    return pickled if len(pickled) <= PICKLED_EXCEPTION_BYTES else b""


def describe_exception(exc: BaseException, *, traceback_text: str | None = None,
                       where: str = "") -> dict[str, Any]:
    """The wire form of an exception raised by user code, every part cut to
    what a report can carry (``cut`` says whether anything was; ``where``
    tells the reader where the whole text is)."""
    tb = traceback_text if traceback_text is not None else \
        "".join(traceback.format_exception(exc))
    cls = type(exc)
    message = _safe_str(exc)
    pickled = _pickle_exception(exc)
    shrunk = len(pickled) > PICKLED_EXCEPTION_BYTES
    if shrunk:
        size = len(pickled)
        pickled = _smaller_exception(exc, where)
        message += (f"\n[remote_tpu: the exception pickles to {size:,} bytes, over the "
                    f"{PICKLED_EXCEPTION_BYTES:,} a report carries: " +
                    ("its large arguments were cut]" if pickled else
                     "it could not be sent as itself]"))
    return {
        "type_name": valid_text(f"{cls.__module__}.{cls.__qualname__}"),
        "message": valid_text(cut_text(message, EXCEPTION_MESSAGE_CHARS, where)),
        "traceback": valid_text(cut_text(tb, TRACEBACK_CHARS, where)),
        "pickled": pickled,
        "cut": shrunk or len(message) > EXCEPTION_MESSAGE_CHARS or len(tb) > TRACEBACK_CHARS,
    }


def rebuild_exception(pickled: bytes) -> BaseException | None:
    """The exception itself, or None when its class cannot be rebuilt here."""
    if not pickled:
        return None
    try:
        exc = pickle.loads(pickled)
    except Exception:  # noqa: BLE001
        return None
    return exc if isinstance(exc, BaseException) else None


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001
        return f"<str() of {type(exc).__name__} failed>"
