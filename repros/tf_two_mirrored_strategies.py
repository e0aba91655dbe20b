"""Two MirroredStrategy instances of different sizes in one process: the second cannot train.

    python repros/tf_two_mirrored_strategies.py

TensorFlow 2.21 (Keras 3), 4 logical CPU devices. The first strategy (2 replicas) trains; the second
(3 replicas) fails with `CancelledError`, the log saying "Device ... is joining a group with size3, but
that group has size 2 (group_key=1)". Each process started fresh for the second strategy trains fine,
which is why difftest gives every TF strategy configuration processes of its own.
"""

import numpy as np
import torch  # noqa: F401  (torch, then triton, before TF: the other order segfaults with CUDA torch builds)

try:
    import triton  # noqa: F401
except ImportError:
    pass
import tensorflow as tf
import keras

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

x = np.ones((24, 4), np.float32)
y = np.eye(3, dtype=np.float32)[np.arange(24) % 3]
for replicas in (2, 3):
    strategy = tf.distribute.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)

    def shard(a, n=replicas, s=strategy):
        return s.experimental_distribute_values_from_function(lambda c: tf.constant(np.split(a, n)[c.replica_id_in_sync_group]))

    def step(xs, ys, m=model, o=optimizer):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(ys, m(xs))) / 24
        grads = tape.gradient(loss, m.trainable_variables)
        o.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    @tf.function
    def train(xs, ys, s=strategy):
        return s.reduce("SUM", s.run(step, args=(xs, ys)), axis=None)

    try:
        print(f"{replicas} replicas: loss {float(train(shard(x), shard(y))):.6f}")
    except Exception as exc:  # noqa: BLE001
        print(f"{replicas} replicas: FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
