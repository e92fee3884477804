"""Quickstart: one function on every host of a (simulated) multi-host TPU slice.

`hosts="local"` starts one agent per simulated host on this machine: tpu-v4-16
is 2 hosts x 4 chips, so 2 processes x 4 CPU devices with real cross-process
collectives. On a real slice, pass the address of any agent of the slice instead.
"""

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local")
def cross_host_sum(scale: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    host = jax.process_index()
    print(f"host {host} of {jax.process_count()}: {jax.local_device_count()} local devices, "
          f"{jax.device_count()} in the slice")

    # Every host contributes its own shard; the sum needs all of them.
    local = np.full((jax.local_device_count(),), (host + 1) * scale)
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    global_array = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("devices")), local)
    total = jax.jit(jnp.sum)(global_array)
    print(f"host {host}: global sum = {float(total)}")
    return {"sum": float(total), "devices": jax.device_count(), "hosts": jax.process_count()}


if __name__ == "__main__":
    result = cross_host_sum(10.0)        # only the leader's prints appear (stream="leader")
    print("returned to the caller:", result)
    expected = 4 * 10.0 * (1 + 2)        # 4 devices per host, hosts valued 1 and 2
    assert result == {"sum": expected, "devices": 8, "hosts": 2}, result
