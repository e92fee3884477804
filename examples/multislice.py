"""Multislice: one data-parallel training job on two slices joined over the
data-center network (DCN).

`num_slices=2` with `hosts="local"` simulates two tpu-v4-16 slices here (2 hosts
x 4 chips each: 4 processes, 16 CPU devices). On real slices, name one host of
each slice, slice 0 first:

    hosts=["10.0.0.2", "10.0.1.2"]                  # any agent of each slice
    hosts="tpu://my-pool?zone=us-east5-a"           # a multislice queued resource's
                                                    # nodes my-pool-0, my-pool-1

Every host gets MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID, MEGASCALE_COORDINATOR_ADDRESS
and MEGASCALE_PORT, which libtpu uses to join the slices; process ids go slice by
slice, as JAX's own Cloud TPU cluster code numbers them.
"""

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local", num_slices=2, stream="all")
def train(steps: int) -> dict:
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    slices = int(os.environ["MEGASCALE_NUM_SLICES"])
    slice_id = int(os.environ["MEGASCALE_SLICE_ID"])
    # A 2D mesh: slices along "dcn" (slow links between slices), each slice's
    # chips along "ici" (its fast interconnect). Process ids go slice by slice,
    # so sorting by process puts each slice's devices in one row. (On real TPUs
    # jax.experimental.mesh_utils.create_hybrid_device_mesh does the same from
    # each device's slice_index, which the CPU simulation does not set.)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(slices, -1), ("dcn", "ici"))
    if jax.process_index() % (jax.process_count() // slices) == 0:
        print(f"slice {slice_id}: {len(devices) // slices} chips of {len(devices)}")

    # Each process loads its own shard of the batch: y = 3x + 1 with noise.
    rng = np.random.default_rng(jax.process_index())
    x = rng.normal(size=(jax.local_device_count() * 8, 1)).astype(np.float32)
    y = 3 * x + 1 + 0.01 * rng.normal(size=x.shape).astype(np.float32)
    batch = NamedSharding(mesh, P(("dcn", "ici")))       # split over every chip
    x = jax.make_array_from_process_local_data(batch, x)
    y = jax.make_array_from_process_local_data(batch, y)
    params = {"w": jnp.zeros((1, 1)), "b": jnp.zeros((1,))}   # a replica on every chip

    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    @jax.jit
    def step(p, x, y):
        # The mean over the global batch: XLA reduces within each slice over
        # ICI, then across slices over DCN.
        value, grads = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    losses = []
    for _ in range(steps):
        params, value = step(params, x, y)
        losses.append(float(value))
    return {"first_loss": losses[0], "last_loss": losses[-1],
            "w": float(params["w"][0, 0]), "b": float(params["b"][0]),
            "processes": jax.process_count(), "slices": slices}


if __name__ == "__main__":
    result = train(60)
    print("returned to the caller:", result)
    assert result["processes"] == 4 and result["slices"] == 2, result
    assert result["last_loss"] < result["first_loss"] / 100, result
    assert abs(result["w"] - 3) < 0.05 and abs(result["b"] - 1) < 0.05, result
