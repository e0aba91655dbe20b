"""A model kind and a setting family added the way a user adds theirs: this one file, registered with `--plugin`.

`tiny-mlp` is a small tanh MLP with its own tensor names (`layer<i>.weight`), its own order of computation and its
own reductions; `sum-dp` is a hand-written data-parallel family whose `grad-sum` variant all-reduces gradients with
SUM and forgets to divide by the world size (a planted bug), beside a correct `mean` variant. The engine knows neither
by name: `tests/test_plugin.py` runs them through generation, the sweep, judging, triage and minimisation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import (
    Batch,
    Generator,
    ModelSpec,
    Outputs,
    RunContext,
    Setting,
    record_training,
    register_generator,
    register_settings,
    to_numpy,
)

KIND = "tiny-mlp"


class TinyMlp(Generator):
    kind = KIND
    traits = frozenset({"torch"})

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = np.random.default_rng([seed, index, 7])
        widths = [int(rng.integers(2, 6))] + [int(rng.integers(2, 6)) for _ in range(3)] + [1]
        return ModelSpec(kind=KIND, seed=seed, index=index, params={"widths": widths})

    @staticmethod
    def _shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        widths = params["widths"]
        shapes: dict[str, tuple[int, ...]] = {}
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            shapes[f"layer{i}.weight"], shapes[f"layer{i}.bias"] = (b, a), (b,)
        return shapes

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([spec.seed, spec.index, 8])
        return {name: rng.uniform(-0.5, 0.5, shape).astype(np.float32) for name, shape in self._shapes(spec.params).items()}

    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        rng = np.random.default_rng([spec.seed, spec.index, 9, spec.input_seed])
        width = spec.params["widths"][0]
        return {split: Batch(labels=rng.normal(size=batch_size).astype(np.float32),
                             dense=rng.normal(size=(batch_size, width)).astype(np.float32))
                for split in ("train", "eval")}

    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None,
              **options: Any) -> Any:
        import torch

        widths = spec.params["widths"]
        module = torch.nn.ModuleDict({f"layer{i}": torch.nn.Linear(a, b) for i, (a, b) in enumerate(zip(widths, widths[1:]))})
        module.load_state_dict({k: torch.from_numpy(v) for k, v in init_state.items()})
        return module.to(device)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        import torch

        inner = getattr(module, "module", module)  # inside DistributedDataParallel
        x = torch.as_tensor(batch.dense, device=device, dtype=next(inner.parameters()).dtype)
        for i, layer in enumerate(inner.values()):
            x = layer(x) if i == len(inner) - 1 else torch.tanh(layer(x))
        return x.squeeze(-1)

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        return {"prediction": self.forward(module, batch, device)}

    def loss(self, prediction: Any, batch: Batch) -> Any:
        import torch

        labels = torch.as_tensor(batch.labels, device=prediction.device, dtype=prediction.dtype)
        return torch.mean((prediction - labels) ** 2)

    def parameters(self, module: Any) -> dict[str, Any]:
        return dict(getattr(module, "module", module).named_parameters())

    # capabilities
    def size(self, spec: ModelSpec) -> dict[str, int]:
        widths = spec.params["widths"]
        return {"layers": len(widths) - 1, "parameters": sum(a * b + b for a, b in zip(widths, widths[1:]))}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        widths = spec.params["widths"]
        return [(f"without hidden layer {i}", {"widths": widths[:i] + widths[i + 1:]}) for i in range(1, len(widths) - 1)]

    def frozen_names(self, params: dict[str, Any]) -> set[str]:
        return set(self._shapes(params))

    def tensor_class(self, tensor: str) -> str:
        return re.sub(r"^layer\d+\..*", "layer", tensor)  # a bug in any parameter of any layer is one finding

    def tensor_order(self, tensor: str) -> tuple[int, int]:
        layer = re.match(r"layer(\d+)\.", tensor)
        return (0, int(layer.group(1))) if layer else (1, 0) if tensor == "prediction" else (2, 0)


@dataclass(frozen=True)
class SumDataParallel(Setting):
    """Data parallel by hand: each rank trains on its share, gradients all-reduced after backward."""

    world_size: int
    reduce: str  # mean: divide the summed gradients by the world size; grad-sum: forget to (the planted bug)
    family: ClassVar[str] = "sum-dp"

    @property
    def name(self) -> str:
        return f"sum-dp/{self.reduce}/ws{self.world_size}"

    def run(self, ctx: RunContext, model: Any, inputs: Any) -> Outputs | None:
        import torch
        import torch.distributed as dist

        module = model.build(ctx.device)
        optimizer = torch.optim.SGD(module.parameters(), lr=ctx.lr)

        def train_step(batch: Batch) -> float:
            optimizer.zero_grad()
            loss = model.loss(model.forward(module, batch, ctx.device), batch)
            loss.backward()
            for parameter in module.parameters():
                dist.all_reduce(parameter.grad, group=ctx.group)
                if self.reduce == "mean":
                    parameter.grad /= ctx.world_size
            optimizer.step()
            return loss.item()

        def parameters() -> dict[str, np.ndarray] | None:
            return {n: to_numpy(t) for n, t in model.parameters(module).items()} if ctx.rank == 0 else None

        return record_training(ctx, inputs, lambda b: model.evaluate(module, b, ctx.device), train_step, parameters)


register_generator(KIND, TinyMlp())
register_settings(SumDataParallel(ws, reduce) for ws in (2, 3) for reduce in ("mean", "grad-sum"))
