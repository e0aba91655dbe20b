"""TensorFlow's own distribution strategies against single-device TensorFlow (the D3 TF side).

One custom training loop serves every strategy (Keras 3 `fit` cannot take per-replica values under
MultiWorkerMirrored here): each replica takes its contiguous share of the same global batch, the loss is
the per-example sum over the *global* batch size, and Keras' SGD applies the all-reduced gradient. Models
train in their inference form (see `generators.sequential`), with op determinism on.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    Outputs,
    RunContext,
    Setting,
    Unsupported,
    gather_to_rank0,
    register_setting,
    register_settings,
    traits_of,
)
from generators import _tf
from generators.sequential import weight_name

TF_REFERENCE = "tf/reference"
STRATEGIES = ("default", "mirrored", "central-storage", "multi-worker")


@dataclass(frozen=True)
class TensorFlowStrategy(Setting):
    """A tf.distribute strategy, custom training loop, plain SGD."""

    strategy: str
    replicas: int = 1
    world_size: int = 1  # processes: only multi-worker uses more than one
    family: ClassVar[str] = "tensorflow"
    size_parameters: ClassVar[frozenset[str]] = frozenset({"world_size", "replicas"})
    framework: ClassVar[str] = "tensorflow"
    tier_axes: ClassVar[tuple[str, ...]] = ("strategy",)
    reference: ClassVar[str] = TF_REFERENCE

    @property
    def name(self) -> str:
        if self.strategy == "default":
            return TF_REFERENCE
        if self.strategy == "multi-worker":
            return f"tf/multi-worker/ws{self.world_size}"
        return f"tf/{self.strategy}/r{self.replicas}"

    def describe(self) -> str:
        if self.strategy == "default":
            return "TensorFlow single device, op determinism, custom loop, plain SGD (the TF reference)"
        if self.strategy == "multi-worker":
            return f"MultiWorkerMirroredStrategy, {self.world_size} worker processes on 127.0.0.1"
        return f"{self.strategy} strategy over {self.replicas} logical CPU devices"

    @property
    def sample_order_free(self) -> bool:  # type: ignore[override]
        return self.strategy == "default"

    @property
    def scale(self) -> int:
        return self.world_size * self.replicas

    @property
    def process_affinity(self) -> str:
        # TF numbers collective groups per process: a second MirroredStrategy in the same process fails
        # ("joining a group with size 3, but that group has size 2"), so each strategy configuration gets
        # processes of its own and reuses one strategy object there (repros/tf_two_mirrored_strategies.py)
        return "" if self.strategy == "default" else self.name

    def supports(self, spec: Any) -> str | None:
        return None if "keras" in traits_of(spec.kind) else f"TensorFlow settings run Keras models; kind {spec.kind!r} is PyTorch-only"

    def available(self) -> str | None:
        return _tf.missing()

    @property
    def collectives(self) -> frozenset[str]:
        return frozenset()  # TensorFlow runs its own; torch's group only swaps the workers' ports, as CPU objects

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        tf, keras = _tf.import_tensorflow()
        strategy = self._strategy(ctx, tf)
        replicas = strategy.num_replicas_in_sync
        global_batch = inputs.train.size
        with strategy.scope():
            keras_model = model.generator.keras_model(model.spec, model.init_state)
            optimizer = keras.optimizers.SGD(learning_rate=ctx.lr)
        recorded = [w for w in keras_model.weights if not w.path.endswith(("moving_mean", "moving_variance"))]

        def distribute(array: np.ndarray) -> Any:
            shards = np.split(array, replicas)
            return strategy.experimental_distribute_values_from_function(
                lambda value_context: tf.constant(shards[value_context.replica_id_in_sync_group])
            )

        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = keras_model(x, training=False)
                loss = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(y, logits)) / self.loss_denominator(global_batch, replicas)
            variables = keras_model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        @tf.function
        def train(x: Any, y: Any) -> Any:
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

        @tf.function
        def predict(x: Any) -> Any:
            return strategy.run(lambda v: keras_model(v, training=False), args=(x,))

        outputs: Outputs = {}

        def record_predictions(phase: str) -> None:
            local = strategy.experimental_local_results(predict(distribute(inputs.eval.dense)))
            pieces = gather_to_rank0(ctx, np.concatenate([t.numpy() for t in local]))
            if pieces is not None:
                outputs[f"{phase}/logits"] = np.concatenate(pieces)

        record_predictions("eval_before")
        x, y = distribute(inputs.train.dense), distribute(inputs.train.labels)
        for step in range(1, ctx.steps + 1):
            loss = float(train(x, y).numpy())
            outputs[f"train_step{step}/loss"] = np.array([loss])
            for weight in recorded:
                outputs[f"param_after_step{step}/{weight_name(weight)}"] = np.array(weight.numpy())
        record_predictions(f"eval_after_step{ctx.steps}")
        ctx.notes["replicas"] = str(replicas)
        return outputs if ctx.rank == 0 else None

    def loss_denominator(self, global_batch: int, replicas: int) -> int:
        """Per-replica losses are sums over the *global* batch size, so the all-reduced gradient is its mean."""
        return global_batch

    def _strategy(self, ctx: RunContext, tf: Any) -> Any:
        # one strategy object per process, reused by every case: a second instance in the same process
        # reuses TF's collective group keys and fails, even at the same size (repros/tf_two_mirrored_strategies.py)
        if self.name not in _STRATEGIES:
            devices = [f"/cpu:{i}" for i in range(self.replicas)]
            if self.strategy == "default":
                strategy = tf.distribute.get_strategy()
            elif self.strategy == "mirrored":
                strategy = tf.distribute.MirroredStrategy(devices=devices)
            elif self.strategy == "central-storage":
                strategy = tf.distribute.experimental.CentralStorageStrategy(compute_devices=devices, parameter_device="/cpu:0")
            else:
                strategy = _multi_worker_strategy(ctx, tf)
            _STRATEGIES[self.name] = strategy
        return _STRATEGIES[self.name]


_STRATEGIES: dict[str, Any] = {}


def _multi_worker_strategy(ctx: RunContext, tf: Any) -> Any:
    if ctx.backend != "gloo" or ctx.world_size < 2:
        raise Unsupported("multi-worker runs beside the gloo process group, with 2+ workers")
    with socket.socket() as probe:  # a free loopback port for this worker's TF server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    import torch.distributed as dist

    ports: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ports, port, group=ctx.group)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": ctx.rank},
    })
    return tf.distribute.MultiWorkerMirroredStrategy()


register_setting(TensorFlowStrategy("default"))
register_settings(TensorFlowStrategy("mirrored", r) for r in (1, 2, 3, 4))
register_setting(TensorFlowStrategy("central-storage", 2))
register_setting(TensorFlowStrategy("multi-worker", 1, 2))
