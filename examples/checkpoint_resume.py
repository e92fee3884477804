"""Resume after preemption: an orbax checkpoint saved by every host, a host
lost midway, and the next attempt restoring the latest step and going on.

`retries=` starts the job again on every host when an attempt ends by a
preemption (a host's VM taken back) or, as allowed here, by a failure; each
attempt sees `REMOTE_TPU_ATTEMPT` (0, 1, ...). The function restores whatever
the last attempt checkpointed and continues at the right step. Here host 1
kills itself right after step `--kill-at`'s checkpoint, as a preempted VM
would vanish.

On a local simulated slice the checkpoints go to a local directory every
host sees; on a real slice pass a `gs://bucket/prefix` every host can write.

    python examples/checkpoint_resume.py [--checkpoint-dir DIR] [--steps 12] [--kill-at 5]
"""

import argparse
import tempfile

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local",
                retries=remote_tpu.Retries(preemptions=5, failures=1, backoff=0))
def train(checkpoint_dir: str, steps: int, kill_at: int) -> dict:
    import os
    import signal

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    attempt = int(os.environ.get("REMOTE_TPU_ATTEMPT", "0"))
    # The state is sharded over every device of every host: each host saves
    # (and restores) its own shards of the one checkpoint.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    shape = (jax.device_count() * 2,)
    state = {"w": jax.device_put(jnp.zeros(shape), sharding),
             "step": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}
    manager = ocp.CheckpointManager(checkpoint_dir,
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    resumed_from = manager.latest_step()
    if resumed_from is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(resumed_from, args=ocp.args.StandardRestore(abstract))
        print(f"attempt {attempt}: restored step {resumed_from}", flush=True)

    @jax.jit
    def update(state):
        return {"w": state["w"] + 1.0, "step": state["step"] + 1}

    for step in range(int(state["step"]) + 1, steps + 1):
        state = update(state)
        manager.save(step, args=ocp.args.StandardSave(state))
        if attempt == 0 and step == kill_at:
            manager.wait_until_finished()                       # step kill_at is on disk
            multihost_utils.sync_global_devices("checkpoint written")
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)            # the VM is taken back
    manager.wait_until_finished()
    w = multihost_utils.process_allgather(state["w"], tiled=True)
    return {"attempt": attempt, "resumed_from": resumed_from, "step": int(state["step"]),
            "w_all_equal_steps": bool((np.asarray(w) == steps).all())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", default="")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=5)
    args = parser.parse_args()
    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="remote-tpu-ckpt-")
    result = train(directory, args.steps, args.kill_at)
    print("returned to the caller:", result)
    assert result == {"attempt": 1, "resumed_from": args.kill_at, "step": args.steps,
                      "w_all_equal_steps": True}, result
