"""A model as a setting receives it (`LoadedModel`: spec, generator, initial weights) and the batches it trains and
evaluates on (`Inputs`)."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
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
    # what `build` and `chain` made first, per request, where the generator's are copied (`Generator.builds_copied`)
    _built: dict[tuple[Any, ...], _Built | None] = field(default_factory=dict, repr=False, compare=False)

    def build(self, device: str, **options: Any) -> Any:
        """A fresh unsharded PyTorch module with the initial weights and the frozen parameters frozen."""
        return self._fresh(("build", device, *sorted(options.items())),
                           lambda: self.generator.build(self.spec, self.init_state, device, self.model_dir, **options))

    def chain(self, device: str) -> Any:
        """The model as a LayerChain (difftest/contracts/chain.py) for pipeline stages, if its kind has one."""
        return self._fresh(("chain", device),
                           lambda: self.generator.chain(self.spec, self.init_state, device, self.model_dir))

    def _fresh(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """`make()`, or a deep copy of its first result where the random generators stand where they stood before
        that first call; they are then left where `make()` would leave them, so that what follows draws the same
        numbers (a case's seed puts them in the same state before every build)."""
        if not self.generator.builds_copied:
            return make()
        try:
            known, made = key in self._built, self._built.get(key)
        except TypeError:  # an option no key can hold
            return make()
        if made is None:
            if known:  # one deepcopy cannot copy (it holds a Python module): built every time
                return make()
            before, module = _random_states(), make()
            try:
                self._built[key] = _Built(before, copy.deepcopy(module), _random_states())
            except Exception:
                self._built[key] = None
            return module
        if not _same_states(_random_states(), made.before):
            return make()
        _set_random_states(made.after)
        return copy.deepcopy(made.template)

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


@dataclass(frozen=True)
class _Built:
    before: tuple[Any, Any, Any]  # the random generators' states before the first build (`_random_states`)
    template: Any
    after: tuple[Any, Any, Any]


def _random_states() -> tuple[Any, Any, Any]:
    """torch's CPU generator, numpy's and Python's global ones: what a model's construction may draw from."""
    import torch

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_states(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> bool:
    import torch

    return (torch.equal(a[0], b[0]) and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1])
            and a[1][2:] == b[1][2:] and a[2] == b[2])


def _set_random_states(states: tuple[Any, Any, Any]) -> None:
    import torch

    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


@dataclass
class Inputs:
    train: Batch
    eval: Batch
