"""What `remote-tpu run` and `remote-tpu exec` run on every host: a whole
script as ``__main__``, or a command. Both are functions of this installed
module, so they are pickled by reference and the hosts' remote_tpu runs them.
"""

from __future__ import annotations

from collections.abc import Sequence


class ScriptExit(Exception):
    """A script ended with ``sys.exit(code)``, ``code`` not 0 (or None)."""

    def __init__(self, code: object) -> None:
        super().__init__(f"the script called sys.exit({code!r})")
        self.code = code

    def __reduce__(self):
        return ScriptExit, (self.code,)


class CommandFailed(Exception):
    """A command exited with a status other than 0 (negative: its signal)."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the command exited with {returncode}" if returncode >= 0 else
                         f"the command was killed by signal {-returncode}")
        self.returncode = returncode

    def __reduce__(self):
        return CommandFailed, (self.returncode,)


def run_script(source: str, path: str, argv: Sequence[str], shown: str = "") -> None:
    """Run ``source`` as ``__main__`` (its ``__file__``: ``path``, relative to
    the working directory when it was sent with one), ``sys.argv`` =
    ``[path, *argv]``; its frames in a traceback read ``File "shown"`` (the
    path as its user typed it). jax.distributed is initialized already; a
    script that calls ``jax.distributed.initialize()`` itself runs unchanged."""
    import builtins
    import linecache
    import os
    import sys
    import types

    from ._core.user_source import show_as

    path = os.path.abspath(path)
    show_as(path, shown or path)
    # Its lines, for tracebacks (the file itself need not exist on this host).
    linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    code = compile(source, path, "exec")
    saved_argv, saved_main = sys.argv, sys.modules.get("__main__")
    sys.argv = [path, *argv]
    if os.path.isdir(os.path.dirname(path)) and os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))      # as `python script.py` does
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExit(exc.code) from None
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def run_command(command: Sequence[str]) -> int:
    """Run ``command`` here: one string through the shell (``sh -c``), several
    as the program and its arguments. Its output is this host's; a status
    other than 0 raises CommandFailed (the other hosts go on)."""
    import subprocess

    shell = len(command) == 1
    status = subprocess.run(command[0] if shell else list(command), shell=shell,
                            stdin=subprocess.DEVNULL).returncode
    if status:
        raise CommandFailed(status)
    return 0
