"""A second MirroredStrategy instance in one process cannot train, whatever its size.

    python repros/tf_two_mirrored_strategies.py

TensorFlow 2.21 (Keras 3), 4 logical CPU devices, one Dense layer per model:
  2 replicas, input width 4: trains
  2 replicas, input width 6: InvalidArgumentError in CollectiveReduceV2; the log says "Shape mismatch in
      the collective instance 100 ... expected shape [21] but another member in the group expected shape
      [15]": the new strategy's all-reduce reuses the first strategy's collective instance key
  3 replicas, input width 4: CancelledError; the log says "joining a group with size3, but that group has
      size 2 (group_key=1)"
A fresh process trains each of them fine, so difftest keeps one strategy object per process and
configuration (`process_affinity` in settings/tensorflow.py).
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

y = np.eye(3, dtype=np.float32)[np.arange(24) % 3]
for replicas, width in ((2, 4), (2, 6), (3, 4)):
    strategy = tf.distribute.MirroredStrategy(devices=[f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(3)])
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

    x = np.ones((24, width), np.float32)
    try:
        print(f"{replicas} replicas, input width {width}: loss {float(train(shard(x), shard(y))):.6f}")
    except Exception as exc:  # noqa: BLE001
        print(f"{replicas} replicas, input width {width}: FAILED {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
