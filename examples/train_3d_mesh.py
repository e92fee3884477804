"""Flax + optax training on a 3D (data, fsdp, model) mesh over every host's devices.

The batch is split over the "data" and "fsdp" axes (each host loads only its own
rows); every weight matrix is split over "fsdp" and "model", so no device holds
a whole one; XLA inserts the collectives between hosts. On the local simulated
tpu-v4-16 the mesh is 2 x 2 x 2 over 2 hosts' 8 devices; on a real slice the same
code takes whatever `jax.device_count()` is.

    pip install -e ".[examples]"     # flax, optax
    python examples/train_3d_mesh.py
"""

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
def train(steps: int) -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = jax.device_count()
    model_ways = 2 if n % 2 == 0 else 1
    fsdp_ways = 2 if n % (2 * model_ways) == 0 else 1
    # Devices in process order: each host's devices sit in whole rows of the
    # "data" axis, so a host's own rows of the batch stay on its own devices.
    devices = np.array(jax.devices()).reshape(n // (fsdp_ways * model_ways), fsdp_ways,
                                              model_ways)
    mesh = Mesh(devices, ("data", "fsdp", "model"))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(64, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), ("fsdp", "model")))(x)
            x = nn.relu(x)
            return nn.Dense(1, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), ("model", None)))(x)

    model = MLP()
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    rows = 32 * jax.local_device_count()             # this host's rows of the batch
    rng = np.random.default_rng(jax.process_index())
    x_local = rng.normal(size=(rows, 16)).astype(np.float32)
    y_local = np.sin(x_local.sum(axis=1, keepdims=True))     # a function to learn
    x = jax.make_array_from_process_local_data(batch_sharding, x_local)
    y = jax.make_array_from_process_local_data(batch_sharding, y_local)

    abstract = jax.eval_shape(model.init, jax.random.key(0), x[:1])
    param_shardings = nn.get_sharding(abstract, mesh)       # from with_partitioning
    params = jax.jit(model.init, out_shardings=param_shardings)(jax.random.key(0), x[:1])
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    kernel = params["params"]["Dense_0"]["kernel"].value
    return {"mesh": dict(mesh.shape), "first_loss": losses[0], "last_loss": losses[-1],
            "kernel_spec": str(kernel.sharding.spec),
            "kernel_shard": list(kernel.addressable_shards[0].data.shape),
            "kernel_shape": list(kernel.shape)}


if __name__ == "__main__":
    result = train(150)
    print("returned to the caller:", result)
    assert result["mesh"] == {"data": 2, "fsdp": 2, "model": 2}, result
    assert result["last_loss"] < result["first_loss"] / 4, result       # it learned
    assert result["kernel_spec"] in ("P('fsdp', 'model')", "PartitionSpec('fsdp', 'model')"), result
    assert result["kernel_shard"] == [8, 32] and result["kernel_shape"] == [16, 64], result
