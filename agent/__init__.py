"""remote_tpu_agent: the daemon that runs on every host of a slice.

Installed from the ``agent/`` source directory under the name
``remote_tpu_agent`` so it cannot collide with anything in a user's environment.
"""

from remote_tpu._core.versions import __version__

__all__ = ["__version__"]
