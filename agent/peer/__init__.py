"""The peer role: this host's part of a job some gateway runs (``role``): its
processes started, their events streamed back to the gateway on gRPC, its
link or its warm session's lane.

May import: jobs, host, worker, wire, ``remote_tpu._core`` (never ``gateway``
or ``server``).
"""
