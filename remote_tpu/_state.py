"""``remote_tpu.state``: a dict on each worker process that a warm worker keeps
between calls (``keep_warm``).

It pickles by reference: a function that names it (``remote_tpu.state``, or
``state`` imported from remote_tpu at the top of a notebook or script) finds
the worker's own dict when it runs there, never a copy of the caller's."""

from __future__ import annotations


class State(dict):
    """A plain dict, but for how it travels: by reference to the process's one."""

    def __reduce__(self):
        return (_the_state, ())

    def __repr__(self) -> str:
        return f"remote_tpu.state({dict.__repr__(self)})"


def _the_state() -> State:
    return state


state = State()
