"""A multi-host data loader: each host reads only its own shard of the batch,
and JAX assembles the shards into one global array for a jitted reduction.

This is the input pipeline of every multi-host training job: no host ever holds
the whole batch. `jax.make_array_from_process_local_data` takes each process's
rows and places them on its own devices, as the sharding says.

    python examples/data_loader.py          # a local simulated tpu-v4-16
"""

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
def global_statistics(rows_per_device: int, features: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sharding = NamedSharding(mesh, P("batch"))          # rows split over every device

    # This host's shard: its own rows of the global batch (row r holds the
    # value r in every column), as a loader reading its files would produce.
    local_rows = rows_per_device * jax.local_device_count()
    first = jax.process_index() * local_rows
    shard = np.repeat(np.arange(first, first + local_rows, dtype=np.float32)[:, None],
                      features, axis=1)
    batch = jax.make_array_from_process_local_data(sharding, shard)
    assert batch.shape == (local_rows * jax.process_count(), features)

    @jax.jit
    def stats(x):
        return jnp.sum(x), jnp.mean(x, axis=0), jnp.max(x)

    total, mean, top = stats(batch)
    print(f"host {jax.process_index()}: {local_rows} of {batch.shape[0]} rows here")
    return {"rows": batch.shape[0], "sum": float(total), "mean0": float(mean[0]),
            "max": float(top)}


if __name__ == "__main__":
    result = global_statistics(rows_per_device=16, features=3)
    print("returned to the caller:", result)
    n = result["rows"]                        # rows 0 .. n-1, in 3 columns
    assert n == 16 * 8, result
    assert result == {"rows": n, "sum": 3 * n * (n - 1) / 2, "mean0": (n - 1) / 2,
                      "max": n - 1.0}, result
