"""A model as a chain of units, the form pipeline parallelism splits into stages.

`units[0]` takes the positions (int64 sample indices, contiguous) of samples of the batch last given to
`feed`; every next unit takes what the previous one returned (a tensor, or a tuple of them), and the last
returns the prediction. Composing all units computes exactly the model's forward. Units share their
parameters with nothing outside the chain, so a stage owns the parameters of its units.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from difftest.contracts.batch import Batch


class BatchSource:
    """Holds the batch a chain reads; a unit asks it for the samples at some positions."""

    def __init__(self) -> None:
        self.batch: Batch | None = None

    def samples(self, positions: torch.Tensor) -> Batch:
        if self.batch is None:
            raise RuntimeError("the chain was not fed a batch")
        start = int(positions[0]) if positions.numel() else 0
        expected = torch.arange(start, start + positions.numel(), device=positions.device)
        if positions.numel() and not torch.equal(positions, expected):
            raise ValueError("a chain reads contiguous sample positions only")
        return self.batch.slice(start, start + positions.numel())


class LayerChain:
    def __init__(self, units: list[torch.nn.Module], source: BatchSource,
                 canonical: Callable[[], dict[str, torch.Tensor]], output_name: str) -> None:
        self.units = units
        self.source = source
        self.canonical = canonical  # canonical parameter name -> tensor (a view of a unit's parameter)
        self.output_name = output_name  # what `evaluate` calls the prediction

    def feed(self, batch: Batch) -> None:
        self.source.batch = batch

    def parameters_of(self, modules: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The canonical parameters that live in `modules`, found by the storage they view."""
        storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        return {n: t for n, t in self.canonical().items() if t.untyped_storage().data_ptr() in storages}

    def parameter_counts(self) -> list[int]:
        return [sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in self.units]



class FedUnit(torch.nn.Module):
    """A chain's first unit where the model's first layer takes the batch's inputs as they are: those at the positions
    it is given (one tensor, a tuple of the layer's positional arguments or a dict of its keyword ones), through
    `layer`."""

    def __init__(self, inputs_at: Callable[[torch.Tensor], Any], layer: torch.nn.Module) -> None:
        super().__init__()
        self.inputs_at, self.layer = inputs_at, layer

    def forward(self, positions: torch.Tensor) -> Any:
        inputs = self.inputs_at(positions)
        if isinstance(inputs, dict):
            return self.layer(**inputs)
        return self.layer(*inputs) if isinstance(inputs, tuple) else self.layer(inputs)


class ChainStage(torch.nn.Module):
    """Consecutive units run as one pipeline stage; tuples are spread over the next unit's arguments."""

    def __init__(self, units: list[torch.nn.Module]) -> None:
        super().__init__()
        self.units = torch.nn.ModuleList(units)

    def forward(self, *args: Any) -> Any:
        value: Any = args
        for unit in self.units:
            value = unit(*value) if isinstance(value, tuple) else unit(value)
        return value
