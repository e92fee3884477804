"""Profiling every host: `profile=True` traces the call with jax.profiler on each
host, into the job's output directory, one `host_{i}/` per host, where
TensorBoard's profile plugin and XProf read it.

    python examples/profile.py [--output-dir DIR_OR_GS_URI] [--seconds N]
    tensorboard --logdir DIR/JOB_ID           # the path the call prints

`profile=N` traces only the first N seconds of the call (a long training run's
first steps); on a real slice pass `--output-dir gs://bucket/profiles`.
"""

import argparse
import glob
import os
import tempfile

import remote_tpu


def train_steps(steps: int) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(jnp.ones((jax.device_count() * 64, 256)), NamedSharding(mesh, P("data")))
    w = jnp.full((256, 256), 0.01)

    @jax.jit
    def step(w, x):
        with jax.named_scope("forward"):         # named in the trace
            y = jnp.tanh(x @ w)
        return w - 1e-3 * (x.T @ y) / x.shape[0]

    for _ in range(steps):
        w = step(w, x)
    return float(jnp.sum(w))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="")
    parser.add_argument("--seconds", type=float, default=0, help="0: the whole call")
    args = parser.parse_args()
    output = args.output_dir or tempfile.mkdtemp(prefix="remote-tpu-profiles-")
    run = remote_tpu.run(accelerator="tpu-v4-16", hosts="local", output_dir=output,
                         profile=args.seconds or True)(train_steps)
    print("returned to the caller:", run(20))
    if "://" not in output:
        traces = sorted(glob.glob(os.path.join(output, "*", "host_*", "plugins", "profile",
                                               "*", "*.xplane.pb")))
        hosts = sorted({t.split(os.sep + "plugins")[0].rsplit(os.sep, 1)[1] for t in traces})
        print("traces of", ", ".join(hosts))
        assert hosts == ["host_0", "host_1"], traces
