"""The only code that pickles. Shared by the client, the agent and the worker.

An envelope is::

    b"RTPU" | u32 header length | header (JSON: versions, kind)
            | u32 buffer count | u64 length of each buffer | u64 pickle length
            | pickle stream (protocol 5) | out-of-band buffers, in order

Large buffers (numpy arrays and the like) travel out of band: they are never
copied into the pickle stream, and on loading they are views into the received
bytes, not copies.

Functions from ``__main__``, notebook cells, closures and the user's own local
modules (anything not part of the standard library or of an installed
distribution) are pickled by value, so the hosts need not have them.
"""

from __future__ import annotations

import inspect
import io
import json
import marshal
import pickle
import struct
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle

from . import digests
from .exceptions import SerializationError
from .limits import CHUNK_SIZE
from .local_modules import local_modules_by_value
from .user_source import SOURCES, Sources
from .versions import check_compatible, local_versions

MAGIC = b"RTPU"
_INBAND_LIMIT = 64 * 1024     # smaller buffers stay inside the pickle stream


class Payload:
    """A pickled envelope as a list of parts, sent without joining them; and
    its large buffers that travel apart (``blobs``, in order: see
    ``dumps_call``'s ``blob_min``), each named by its content digest."""

    def __init__(self, parts: list[memoryview], blobs: list[memoryview] | None = None) -> None:
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)
        self.blobs = blobs or []
        # The same call pickled with its buffers inside (set by whoever made it).
        self.inline: Callable[[], Payload] = self._no_inline

    def _no_inline(self) -> Payload:
        if self.blobs:
            raise SerializationError("this payload's large buffers were left apart and it "
                                     "cannot be pickled again with them inside")
        return self

    def blob_digests(self) -> list[bytes]:
        return [digests.of(blob) for blob in self.blobs]

    def chunks(self, size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """Yield the envelope as bytes of at most ``size``, in order."""
        for part in self.parts:
            for start in range(0, part.nbytes, size):
                yield part[start:start + size].tobytes()

    def to_bytes(self) -> bytes:
        return b"".join(p.tobytes() for p in self.parts)

    def digest(self) -> bytes:
        """Its content digest (``digests``), computed over the parts in place."""
        digest = digests.new()
        for part in self.parts:
            digest.update(part)
        return digest.digest()


# --------------------------------------------------------------------------- dump


def _envelope(kind: str, pickled: bytes, buffers: list[pickle.PickleBuffer],
              blob_min: int | None = None) -> Payload:
    raws = [b.raw() for b in buffers]
    external = [i for i, r in enumerate(raws) if blob_min is not None and r.nbytes >= blob_min]
    header = json.dumps({"kind": kind, "versions": local_versions(),
                         **({"external": external} if external else {})}).encode()
    prefix = b"".join([
        MAGIC,
        struct.pack("<I", len(header)), header,
        struct.pack("<I", len(raws)),
        struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)),
        struct.pack("<Q", len(pickled)),
    ])
    apart = set(external)
    return Payload([memoryview(prefix), memoryview(pickled),
                    *(r for i, r in enumerate(raws) if i not in apart)],
                   [raws[i] for i in external])


_BASE_TABLE = cloudpickle.Pickler.dispatch_table
# File objects backed by this machine's files (cloudpickle would read one open
# for reading whole into the payload, and refuse others less clearly).
_OPEN_FILES = (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom,
               io.FileIO)


def _refuse_open_file(f: io.IOBase) -> tuple:
    for stream in ("stdout", "stderr", "stdin"):
        if f is getattr(sys, stream, None) or f is getattr(sys, f"__{stream}__", None):
            return getattr, (sys, stream)        # the host's own, as cloudpickle sends it
    name = getattr(f, "name", None)
    raise pickle.PicklingError(
        f"an open file{f' ({name!r})' if isinstance(name, str) else ''} is not sent: its "
        "file is on this machine, not on the hosts. Pass its path and open it inside the "
        "function (send the file with working_dir= or remote_tpu.Data(path)), or pass "
        "its contents (f.read())")


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with each code object sent whole (``marshal``):
    its file name and line table as the user's own, which cloudpickle 3.1.3
    and later replace by ``<dynamic-code>`` (a remote frame then names no
    file and shows no line). The files of the code it sends by value are
    noted, and :data:`user_source.SOURCES` pickles as their text, so that a
    host without them still shows their lines."""

    def __init__(self, file: io.BytesIO, buffer_callback: Callable) -> None:
        self.code_files: set[str] = set()
        # One flat dict (cloudpickle's is a ChainMap: a Python call for every
        # object looked up), read by the C pickler as it is initialized.
        table: dict = {}
        for reducers in reversed(getattr(_BASE_TABLE, "maps", [_BASE_TABLE])):
            table.update(reducers)
        table[types.CodeType] = self._reduce_code
        table[Sources] = self._reduce_sources
        for kind in _OPEN_FILES:
            table[kind] = _refuse_open_file
        self.dispatch_table = table
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)

    def _reduce_code(self, code: types.CodeType) -> tuple:
        self.code_files.add(code.co_filename)
        return marshal.loads, (marshal.dumps(code),)

    def _reduce_sources(self, _marker: Sources) -> tuple:
        return Sources.of(self.code_files).__reduce__()


def _pickle(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []

    def keep_out_of_band(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes < _INBAND_LIMIT:
            return True      # truthy: serialize in band
        buffers.append(buf)
        return False

    with io.BytesIO() as file:
        _Pickler(file, keep_out_of_band).dump(obj)
        return file.getvalue(), buffers


def dumps(obj: Any, *, what: str = "value", kind: str = "value") -> Payload:
    """Pickle ``obj``; on failure raise SerializationError naming the culprit."""
    with local_modules_by_value():
        try:
            data, buffers = _pickle(obj)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is reported
            raise _unpicklable_error(obj, what, exc) from exc
    return _envelope(kind, data, buffers)


def dumps_call(fn: Any, args: tuple, kwargs: dict, blob_min: int | None = None) -> Payload:
    """Pickle a call. Arguments that do not fit the signature raise TypeError
    here, as a local call would; unpicklable parts are named. With
    ``blob_min``, buffers of that size and more (a large array's data) are
    left out of the envelope, as its ``blobs``: ``loads`` then needs them."""
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{_name(fn)}(): {exc}") from None
    except ValueError:      # no signature (some builtins): nothing to check
        bound = None
    # SOURCES last: it pickles as the text of every file whose code went before.
    call = (fn, args, kwargs, SOURCES)
    with local_modules_by_value():
        try:
            data, buffers = _pickle(call)
        except Exception as exc:  # noqa: BLE001
            raise _call_error(fn, bound, args, kwargs, exc) from exc
    return _envelope("call", data, buffers, blob_min)


# A function's signature, kept while its code and defaults stay the same (a
# repeat call, as from a notebook, skipped inspect.signature's 40-50 us).
_signatures: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(fn: Any) -> inspect.Signature:
    key = (getattr(fn, "__code__", None), getattr(fn, "__defaults__", None),
           getattr(fn, "__kwdefaults__", None), getattr(fn, "__signature__", None))
    try:
        kept = _signatures.get(fn)
    except TypeError:                   # not weakly referable: not kept
        return inspect.signature(fn)
    if kept is not None and kept[0] == key and key[0] is not None:
        return kept[1]
    signature = inspect.signature(fn)
    try:
        _signatures[fn] = (key, signature)
    except TypeError:
        pass
    return signature


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# --------------------------------------------------------------------------- load


def loads_call(data: bytes | bytearray | memoryview, external: Sequence[Any] = ()
               ) -> tuple[Callable, tuple, dict]:
    """A call made by :func:`dumps_call`: (function, args, kwargs). The text of
    the user's files it carries is kept for this process's tracebacks."""
    fn, args, kwargs, sources = loads(data, what="function and arguments", external=external)
    sources.install()
    return fn, args, kwargs


def split(data: bytes | bytearray | memoryview, external: Sequence[Any] = ()
          ) -> tuple[dict, memoryview, list[memoryview]]:
    """Parse an envelope without unpickling: (header, pickle stream, buffers);
    the buffers sent apart are taken from ``external``, in order."""
    view = memoryview(data)
    try:
        if view[:4].tobytes() != MAGIC:
            raise ValueError("bad magic")
        (hlen,) = struct.unpack_from("<I", view, 4)
        header = json.loads(view[8:8 + hlen].tobytes())
        pos = 8 + hlen
        (nbufs,) = struct.unpack_from("<I", view, pos)
        pos += 4
        sizes = struct.unpack_from(f"<{nbufs}Q", view, pos)
        pos += 8 * nbufs
        (plen,) = struct.unpack_from("<Q", view, pos)
        pos += 8
        stream = view[pos:pos + plen]
        pos += plen
        apart = set(header.get("external", ()))
        if len(apart) != len(external):
            raise ValueError(f"{len(apart)} buffer(s) sent apart, {len(external)} given")
        given = iter(external)
        buffers = []
        for i, size in enumerate(sizes):
            if i in apart:
                buffer = memoryview(next(given))
                if buffer.nbytes != size:
                    raise ValueError(f"buffer {i} sent apart has {buffer.nbytes} bytes, "
                                     f"not {size}")
                buffers.append(buffer)
                continue
            buffers.append(view[pos:pos + size])
            pos += size
        if pos != view.nbytes or stream.nbytes != plen:
            raise ValueError(f"length mismatch ({view.nbytes} bytes, expected {pos})")
    except (ValueError, struct.error, json.JSONDecodeError) as exc:
        raise SerializationError(
            f"received data is not a remote_tpu envelope ({exc}); it was truncated "
            "or corrupted in transit, or comes from an incompatible sender") from None
    return header, stream, buffers


def loads(data: bytes | bytearray | memoryview, *, what: str = "value",
          external: Sequence[Any] = ()) -> Any:
    """Unpickle an envelope made by :func:`dumps` or :func:`dumps_call` (with
    the buffers it sent apart, in order)."""
    header, stream, buffers = split(data, external)
    check_compatible(header.get("versions", {}), sender=f"the sender of this {what}")
    try:
        return pickle.loads(stream, buffers=buffers)
    except Exception as exc:  # noqa: BLE001
        raise SerializationError(
            f"could not unpickle the {what}: {type(exc).__name__}: {exc}. A module or "
            "class it refers to may be missing on this side; install it here, or "
            "define it in the calling script so it travels by value.") from exc


# ----------------------------------------------------------------- exceptions


def _call_error(fn: Any, bound: inspect.BoundArguments | None, args: tuple,
                kwargs: dict, exc: Exception) -> SerializationError:
    if bound is not None:
        for name, value in bound.arguments.items():
            found = _find_unpicklable(value, [f"argument {name!r}"])
            if found:
                return _error_for(*found)
    else:
        for i, value in enumerate(args):
            found = _find_unpicklable(value, [f"argument {i}"])
            if found:
                return _error_for(*found)
        for name, value in kwargs.items():
            found = _find_unpicklable(value, [f"argument {name!r}"])
            if found:
                return _error_for(*found)
    return _unpicklable_error(fn, f"function {_name(fn)!r}", exc)


def _unpicklable_error(obj: Any, what: str, exc: Exception) -> SerializationError:
    found = _find_unpicklable(obj, [what])
    if found:
        return _error_for(*found)
    return _error_for([what], obj, exc)


def _error_for(path: list[str], obj: Any, exc: Exception) -> SerializationError:
    return SerializationError(
        f"cannot send {' -> '.join(path)} (a {type(obj).__module__}."
        f"{type(obj).__qualname__}): {exc}. Nothing was sent. Pass a picklable value "
        "instead, or create this object inside the remote function.")


def _picklable(obj: Any) -> Exception | None:
    try:
        _Pickler(io.BytesIO(), lambda b: False).dump(obj)
    except RecursionError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def _find_unpicklable(obj: Any, path: list[str], depth: int = 0,
                      seen: set[int] | None = None) -> tuple[list[str], Any, Exception] | None:
    """The deepest unpicklable part of ``obj`` as (path, object, error), or None."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    exc = _picklable(obj)
    if exc is None:
        return None
    if depth < 8:
        for label, child in _children(obj):
            found = _find_unpicklable(child, path + [label], depth + 1, seen)
            if found:
                return found
    return path, obj, exc


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield f"key {k!r}", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"item {i}", v
    elif isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield f"closure variable {name!r}", cell.cell_contents
            except ValueError:
                continue
        for name in _global_names(code):
            if name in obj.__globals__:
                yield f"global {name!r}", obj.__globals__[name]
    elif isinstance(obj, types.MethodType):
        yield "bound object", obj.__self__
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for k, v in list(state.items()):
                yield f"attribute {k!r}", v
        for slot in getattr(type(obj), "__slots__", ()) or ():
            if isinstance(slot, str) and hasattr(obj, slot):
                yield f"attribute {slot!r}", getattr(obj, slot)


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)
