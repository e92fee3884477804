"""Per-host activation extraction to GCS: every host runs a model over its own
shard of the inputs and writes what it computed to its output directory, which
lands in {output_dir}/{job_id}/host_{i}/ (the per-host outputs workload of
Cloud TPU's multi-host guides).

    python examples/extract_to_gcs.py [--output-dir gs://my-bucket/activations] \\
        [--accelerator tpu-v4-16] [--hosts local]

Without --output-dir the files come back to a new local temporary directory
(named at the end). On a real slice pass its agent (--hosts 10.0.0.2) or
tpu://NAME?zone=... and a gs:// --output-dir; the hosts upload with their own
credentials. Against a local GCS emulator, set
STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT first (the tests do).
"""

import argparse
import tempfile

import remote_tpu


def extract(num_examples: int, width: int) -> dict:
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    host, hosts = jax.process_index(), jax.process_count()
    # The same small model on every host (same seed); each host its own shard of inputs.
    key = jax.random.PRNGKey(0)
    w1 = jax.random.normal(key, (width, 4 * width)) / np.sqrt(width)
    w2 = jax.random.normal(jax.random.fold_in(key, 1), (4 * width, width)) / np.sqrt(width)
    shard = np.array_split(np.arange(num_examples), hosts)[host]
    inputs = jax.random.normal(jax.random.fold_in(key, 2), (num_examples, width))[shard]

    @jax.jit
    def hidden(x):
        return jax.nn.gelu(x @ w1) @ w2

    acts = np.asarray(hidden(jnp.asarray(inputs)))
    out = remote_tpu.output_dir()                      # this host's: saved under host_{i}/
    np.save(os.path.join(out, "activations.npy"), acts)
    np.save(os.path.join(out, "example_ids.npy"), shard)
    if host == 0:                                      # one summary for the whole job
        with open(os.path.join(remote_tpu.output_dir(shared=True), "model.txt"), "w") as f:
            f.write(f"width={width} examples={num_examples} hosts={hosts}\n")
    print(f"host {host}: {len(shard)} examples -> activations {acts.shape}")
    return {"hosts": hosts, "rows_on_host_0": int(acts.shape[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="",
                        help="gs://bucket/prefix, or a local directory (default: a new "
                             "temporary one)")
    parser.add_argument("--accelerator", default="tpu-v4-16")
    parser.add_argument("--hosts", default="local")
    parser.add_argument("--examples", type=int, default=64)
    args = parser.parse_args()
    output = args.output_dir or tempfile.mkdtemp(prefix="remote-tpu-activations-")
    run = remote_tpu.run(accelerator=args.accelerator, hosts=args.hosts,
                         output_dir=output)(extract)
    handle = run.submit(args.examples, 16)
    print("returned:", handle.result())
    for uri in handle.outputs():
        print(uri)


if __name__ == "__main__":
    main()
