"""The worker processes: the child process itself (``child``, run as
``python -m remote_tpu_agent.worker.child``, with ``child_output`` and
``profile`` inside it), the frames agent and child exchange (``frames``),
one run of a child and its outcome (``run``, ``call``, ``output_pipe``,
``output_filter``, ``stacks``), spare children started ahead of their job
(``spares``), the environment a child sees (``environment``) and the one place
that stops processes (``processes``).

May import: wire, ``remote_tpu._core``. The child imports only what it needs
(this package's ``__init__`` imports nothing).
"""
