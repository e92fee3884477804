"""Keras 3 on the JAX backend, data-parallel over every host with Keras's
distribution API.

`keras.distribution.DataParallel` replicates the model on every device of every
host and splits each batch over them; each host feeds only its own rows
(`model.fit` on a host's local arrays), and Keras assembles the global batch.
`KERAS_BACKEND=jax` is set on every host through `env=`, before Keras is imported.

    pip install -e ".[examples]"     # keras
    python examples/keras_data_parallel.py
"""

import remote_tpu


@remote_tpu.run(accelerator="tpu-v4-16", hosts="local", env={"KERAS_BACKEND": "jax"})
def fit(epochs: int) -> dict:
    import jax
    import keras
    import numpy as np

    devices = keras.distribution.list_devices()          # every host's devices
    # Each host's arrays are already its own rows: Keras need not shard them.
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices, auto_shard_dataset=False))

    rng = np.random.default_rng(jax.process_index())
    x = rng.normal(size=(256, 8)).astype("float32")      # this host's rows only
    y = (x @ np.arange(1, 9, dtype="float32"))[:, None] / 10

    # Every host starts from the same weights (a replicated model must be equal
    # everywhere: JAX checks it, and says so if not).
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    losses = history.history["loss"]
    kernel = model.layers[0].kernel.value
    return {"backend": keras.backend.backend(), "devices": len(devices),
            "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
            "replicated": kernel.sharding.is_fully_replicated}


if __name__ == "__main__":
    result = fit(12)
    print("returned to the caller:", result)
    assert result["backend"] == "jax" and result["devices"] == 8, result
    assert result["replicated"], result                   # a whole model on every device
    assert result["last_loss"] < result["first_loss"] / 5, result
