"""A small public surface: one sorted, complete __all__; importing does not import jax."""

import types

import remote_tpu
from conftest import run_python


def test_all_is_sorted_and_complete():
    assert remote_tpu.__all__ == sorted(remote_tpu.__all__)
    public = {n for n in dir(remote_tpu)
              if not n.startswith("_") and not isinstance(getattr(remote_tpu, n),
                                                          types.ModuleType)}
    assert public | {"__version__"} == set(remote_tpu.__all__)
    for name in remote_tpu.__all__:
        assert getattr(remote_tpu, name) is not None


def test_one_exception_base():
    for name in remote_tpu.__all__:
        obj = getattr(remote_tpu, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and \
                obj is not remote_tpu.RemoteTraceback:
            assert issubclass(obj, remote_tpu.RemoteTPUError), name


def test_import_does_not_import_jax():
    proc = run_python("import sys, remote_tpu; print('jax' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_import_is_light_until_the_client_is_used():
    # A worker imports remote_tpu to unpickle a function: without gRPC and protobuf.
    proc = run_python("import sys, remote_tpu; light = 'grpc' not in sys.modules and "
                      "'google.protobuf' not in sys.modules; remote_tpu.run; "
                      "print(light, 'grpc' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True True"


def test_cli_version():
    proc = run_python("from remote_tpu._cli import main; raise SystemExit(main(['version']))")
    assert proc.returncode == 0, proc.stderr
    assert f'"remote_tpu": "{remote_tpu.__version__}"' in proc.stdout
