"""The one pickling module: by-value shipping, out-of-band buffers, naming culprits."""

import json
import pickle
import struct
import sys
import textwrap
import threading

import numpy as np
import pytest

from conftest import run_python
from remote_tpu import SerializationError, VersionMismatchError
from remote_tpu._core import remote_exceptions as remote_exception
from remote_tpu._core import serialization as ser


def _load_elsewhere(payload: ser.Payload, tmp_path, expr: str) -> str:
    """Unpickle in a fresh interpreter whose sys.path lacks tmp_path and tests/."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    blob = tmp_path / "payload.bin"
    blob.write_bytes(payload.to_bytes())
    empty = tmp_path / "cwd"
    empty.mkdir()
    code = textwrap.dedent(f"""
        from remote_tpu._core import serialization as ser
        fn, args, kwargs = ser.loads_call(open({str(blob)!r}, 'rb').read())
        print(repr({expr}))
    """)
    proc = run_python(code, cwd=str(empty))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_unpicklable_argument_is_named():
    class Opt:
        def __init__(self):
            self.lr = 0.1
            self.lock = threading.Lock()

    def train(opt):
        return opt.lr

    with pytest.raises(SerializationError) as info:
        ser.dumps_call(train, (Opt(),), {})
    msg = str(info.value)
    assert "argument 'opt' -> attribute 'lock'" in msg
    assert "_thread.lock" in msg and "Nothing was sent" in msg


def test_unpicklable_keyword_and_nested_container_are_named():
    def f(x, cfg=None):
        return x

    with pytest.raises(SerializationError, match=r"argument 'cfg' -> key 'io' -> item 1"):
        ser.dumps_call(f, (1,), {"cfg": {"io": [1, threading.Lock()]}})


def test_unpicklable_closure_variable_is_named():
    lock = threading.Lock()

    def f():
        return lock

    with pytest.raises(SerializationError, match=r"function 'test_unpicklable_closure.*"
                                                 r"closure variable 'lock'"):
        ser.dumps_call(f, (), {})


def test_wrong_arguments_fail_like_a_local_call():
    def f(a, b):
        return a + b

    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        ser.dumps_call(f, (1,), {})


def test_large_array_travels_out_of_band_and_round_trips(tmp_path):
    a = np.random.default_rng(0).standard_normal(8 * 1024 * 1024)   # 64 MiB
    payload = ser.dumps(a)
    assert payload.nbytes < a.nbytes + 4096
    # The array is not inside the pickle stream: it is one of the parts, uncopied.
    assert any(p.nbytes == a.nbytes for p in payload.parts)
    data = bytearray(payload.to_bytes())
    b = ser.loads(data)
    assert np.array_equal(a, b)
    # Loaded arrays are views of the received bytes, not copies.
    assert np.shares_memory(b, np.frombuffer(data, dtype=np.uint8))


def test_chunks_reassemble_exactly():
    payload = ser.dumps({"x": np.arange(3_000_000), "y": "text"})
    chunks = list(payload.chunks(1 << 20))
    assert all(len(c) <= 1 << 20 for c in chunks)
    assert b"".join(chunks) == payload.to_bytes()


def test_exec_defined_function_is_shipped_by_value(tmp_path):
    namespace: dict = {}
    exec("def cell(x):\n    return x * 7\n", namespace)     # a notebook cell
    payload = ser.dumps_call(namespace["cell"], (6,), {})
    assert _load_elsewhere(payload, tmp_path, "fn(*args)") == "42"


def test_closure_is_shipped_by_value(tmp_path):
    factor = 3

    def scaled(x):
        return x * factor

    payload = ser.dumps_call(scaled, (5,), {})
    assert _load_elsewhere(payload, tmp_path, "fn(*args)") == "15"


def test_function_from_a_local_module_is_shipped_by_value(tmp_path, monkeypatch):
    pkg = tmp_path / "mylocalhelpers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .maths import triple\n")
    (pkg / "maths.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import mylocalhelpers

    def uses_helper(x):
        return mylocalhelpers.triple(x)

    try:
        payload = ser.dumps_call(uses_helper, (4,), {})
    finally:
        for name in [m for m in sys.modules if m.startswith("mylocalhelpers")]:
            del sys.modules[name]
    # The helper module stays registered by value only for the one dump.
    import cloudpickle
    assert not cloudpickle.list_registry_pickle_by_value()
    assert _load_elsewhere(payload, tmp_path / "elsewhere", "fn(*args)") == "12"


def _with_header(payload: ser.Payload, **versions) -> bytes:
    data = payload.to_bytes()
    (hlen,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8:8 + hlen])
    header["versions"].update(versions)
    new = json.dumps(header).encode()
    return data[:4] + struct.pack("<I", len(new)) + new + data[8 + hlen:]


def test_python_and_cloudpickle_mismatch_names_both_versions():
    data = _with_header(ser.dumps(1), python="3.9.1", cloudpickle="0.0.1")
    with pytest.raises(VersionMismatchError) as info:
        ser.loads(data)
    msg = str(info.value)
    assert "Python 3.9.1 on the sender of this value" in msg
    assert "cloudpickle 0.0.1 on the sender of this value" in msg and "on this process" in msg
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in msg


def test_truncated_or_garbage_input_is_a_clear_error():
    data = ser.dumps(list(range(100))).to_bytes()
    with pytest.raises(SerializationError, match="truncated or corrupted"):
        ser.loads(data[:-10])
    with pytest.raises(SerializationError, match="not a remote_tpu envelope"):
        ser.loads(b"garbage")


def test_exception_round_trip_and_unbuildable():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        info = remote_exception.describe_exception(exc)
    assert info["type_name"] == "builtins.KeyError"
    assert "raise KeyError" in info["traceback"]
    assert isinstance(remote_exception.rebuild_exception(info["pickled"]), KeyError)
    assert remote_exception.rebuild_exception(pickle.dumps(ValueError("x"))[:-3]) is None
    assert remote_exception.rebuild_exception(b"") is None



def test_a_repeat_call_checks_its_arguments_against_the_function_as_it_is_now():
    """The signature is kept between calls (a notebook calls one function again
    and again), but a function whose defaults or code changed is checked anew."""
    def f(a, b=2):
        return a + b

    ser.dumps_call(f, (1,), {})
    ser.dumps_call(f, (1,), {})                       # (the kept signature)
    f.__defaults__ = None
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        ser.dumps_call(f, (1,), {})

    def g(x):
        return x
    ser.dumps_call(g, (1,), {})
    g.__code__ = f.__code__
    with pytest.raises(TypeError, match="missing a required argument"):
        ser.dumps_call(g, (1,), {})


def test_an_open_file_argument_is_refused_with_what_to_do(tmp_path):
    data = tmp_path / "rows.csv"
    data.write_text("a,b\n" * 1000)

    def f(rows, cfg=None):
        return rows

    with open(data) as handle, pytest.raises(SerializationError) as info:
        ser.dumps_call(f, (1,), {"cfg": {"input": handle}})
    message = str(info.value)
    assert "argument 'cfg' -> key 'input'" in message and str(data) in message, message
    assert "working_dir=" in message and "remote_tpu.Data" in message and "f.read()" in message
    with open(data, "rb") as handle, pytest.raises(SerializationError, match="open file"):
        ser.dumps_call(f, (handle,), {})


def test_the_standard_streams_still_travel_as_the_hosts_own():
    done = run_python(textwrap.dedent("""
        import sys
        from remote_tpu._core import serialization as ser
        def f(x, out=sys.stderr):
            return out is sys.stderr
        fn, args, kwargs = ser.loads_call(ser.dumps_call(f, (1,), {}).to_bytes())
        print(fn(*args))
    """))
    assert done.stdout.strip() == "True", done.stderr
