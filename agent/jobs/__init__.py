"""Jobs as this agent knows them: the durable store (``store``), one job's
record (``record``), each host's bounded output log (``host_log``), a job's
event queue (``events``), reading jobs back for callers (``views``), the
checks a request gets and how a refusal is said (``requests``), and the
gateway's ``retries=`` policy between attempts (``attempts``).

May import: host-independent pieces below it: worker (file names, the
environment's shape), wire, ``remote_tpu._core``.
"""
