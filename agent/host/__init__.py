"""What this host offers every job, whichever role: the agent's settings
(``config``), what the two roles share (``shared.Host``), the argument cache
(``blobs``, ``blob_sends``, ``cache_dir``), the caller's project trees
(``working_dirs``), ``output_dir=`` uploads (``output_dir``), payload uploads
(``uploads``), interpreters and ``requirements=`` environments (``pythons``,
``envs``), preparing a job's part before it runs (``preparing``), TPU lock
hygiene (``tpu``), how long the host has had no work (``idle``) and the slice
deleted once that is long enough (``idle_delete``).

May import: jobs, worker, wire, ``remote_tpu._core``.
"""
