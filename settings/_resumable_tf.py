"""The TensorFlow resumable program (settings/resume_tensorflow.py runs it): SGD with momentum 0.9 and a
staircase learning rate halved every 2 steps, fed by a tf.data pipeline that reshuffles the training samples
every epoch (seeded) and serves half of them per step; `tf.train.Checkpoint` carries model, optimizer and the
tf.data iterator itself. `phase_main` runs the second phase in a fresh process."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from difftest import Outputs, load_model
from generators import _tf
from generators.sequential import weight_name

TOTAL_STEPS = 5


def run_phase(model: Any, inputs: Any, seed: int, lr: float, first: int, last: int, checkpoint: Path | None,
              save: bool) -> Outputs:
    tf, keras = _tf.import_tensorflow()
    tf.random.set_seed(seed)
    keras_model = model.generator.keras_model(model.spec, model.init_state)
    schedule = keras.optimizers.schedules.ExponentialDecay(lr, decay_steps=2, decay_rate=0.5, staircase=True)
    optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=0.9)
    optimizer.build(keras_model.trainable_variables)  # slots exist before a restore fills them
    samples = tf.data.Dataset.from_tensor_slices((inputs.train.dense, inputs.train.labels))
    batches = samples.shuffle(inputs.train.size, seed=seed, reshuffle_each_iteration=True) \
        .batch(inputs.train.size // 2).repeat()
    iterator = iter(batches)
    state = tf.train.Checkpoint(model=keras_model, optimizer=optimizer, iterator=iterator)
    if first > 0:
        assert checkpoint is not None
        state.restore(str(checkpoint / "ckpt-1")).assert_consumed()
    recorded = [w for w in keras_model.weights if not w.path.endswith(("moving_mean", "moving_variance"))]

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(y, keras_model(x, training=False)))
        variables = keras_model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    def logits() -> np.ndarray:
        return np.array(keras_model(tf.constant(inputs.eval.dense), training=False))

    outputs: Outputs = {} if first else {"eval_before/logits": logits()}
    for step in range(first + 1, last + 1):
        x, y = next(iterator)
        outputs[f"train_step{step}/loss"] = np.array([float(train_step(x, y))])
        outputs.update({f"param_after_step{step}/{weight_name(w)}": np.array(w.numpy()) for w in recorded})
    if save:
        assert checkpoint is not None
        state.save(str(checkpoint / "ckpt"))
    if last == TOTAL_STEPS:
        outputs[f"eval_after_step{TOTAL_STEPS}/logits"] = logits()
    return outputs


def phase_main(request: Mapping[str, Any], rank: int = 0) -> Outputs:
    """The second phase, in a process of its own (`run_in_processes` starts it): nothing of the first phase's
    TensorFlow state but the checkpoint."""
    model, inputs = load_model(Path(request["model_dir"]))
    return run_phase(model, inputs, request["seed"], request["lr"], request["first"], request["last"],
                     Path(request["checkpoint"]), save=request["last"] < TOTAL_STEPS)
