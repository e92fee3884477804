"""The agent's front door: the ``remote-tpu-agent`` command (``cli``), the gRPC
servicer that maps each RPC to the object doing the work (``service``), the
slice token check on every call (``guard``), the bounded thread slots of
long-lived calls (``slots``) and questions about the host and slice rather
than a job (``slice_queries``).

May import: every wing below it (gateway, peer, jobs, host, worker, wire) and
``remote_tpu._core``. Nothing imports it but ``remote_tpu_agent.__main__``.
"""
