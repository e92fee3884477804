"""The gateway role: this host takes a job from a caller for its whole slice.
It queues jobs one at a time (``scheduler``, ``scheduler_warm``), runs one
across every host as process 0 (``job``: fan-out, merged events, fail-fast),
keeps warm sessions between calls (``warm``), checks the peers first
(``preflight``), stands in for each process on a peer (``peer_process``),
names the root cause of a failure (``root_cause``) and bounds the reports it
gathers (``reports``). ``role`` ties it together for the servicer.

May import: peer's equals only through the wire (never ``peer``), and the
wings below: jobs, host, worker, wire, ``remote_tpu._core``.
"""
