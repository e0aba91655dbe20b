"""A model as a setting receives it (`LoadedModel`: spec, generator, initial weights) and the batches it trains and
evaluates on (`Inputs`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from difftest.contracts.batch import Batch
from difftest.contracts.generator import Generator
from difftest.contracts.spec import ModelSpec


@dataclass
class LoadedModel:
    """A model as a setting receives it: the spec, its generator, the initial weights and its folder."""

    spec: ModelSpec
    generator: Generator
    init_state: dict[str, np.ndarray]
    model_dir: Path | None = None

    def build(self, device: str, **options: Any) -> Any:
        """A fresh unsharded PyTorch module with the initial weights and the frozen parameters frozen."""
        return self.generator.build(self.spec, self.init_state, device, self.model_dir, **options)

    def chain(self, device: str) -> Any:
        """The model as a LayerChain (difftest/contracts/chain.py) for pipeline stages, if its kind has one."""
        return self.generator.chain(self.spec, self.init_state, device, self.model_dir)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        return self.generator.forward(module, batch, device)

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """Named evaluation tensors (predictions and whatever intermediates the generator exposes)."""
        return self.generator.evaluate(module, batch, device)

    def loss(self, prediction: Any, batch: Batch) -> Any:
        """The mean training loss over `batch` (so shares of equal size average to the global loss)."""
        return self.generator.loss(prediction, batch)

    def parameters(self, module: Any) -> dict[str, Any]:
        """Canonical parameter name → tensor of an unsharded module (possibly wrapped by DDP)."""
        return self.generator.parameters(module)

    def blocks(self, module: Any) -> list[tuple[str, Any]] | None:
        """(name, submodule) of the repeated blocks of an architecture that has them (a transformer's layers), which
        per-block wrapping (FSDP2) takes as its units; None when the kind has no such structure."""
        return self.generator.blocks(module)

    def tp_plan(self, module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any] | None:
        """The architecture's own tensor-parallel plan (module name → ParallelStyle), as its authors would write it;
        None when the kind has none and a setting derives one from the module's layers."""
        return self.generator.tp_plan(module, world_size, sequence_parallel, loss_parallel)


@dataclass
class Inputs:
    train: Batch
    eval: Batch
