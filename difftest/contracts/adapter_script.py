"""A user's model (`ModelAdapter`) in a standalone script: the functions a script copies (`inspect.getsource`) to build,
feed and train it as `AdapterGenerator` does, beside the user's own callables (`difftest.contracts.user_code`), which
the script reaches through its `ADAPTER` dict (role → callable: "model", "loss", and where the adapter gives them
"prediction", "tp_plan", "chain"). The script's data holds the case's weights (`state.<name>`) and training batch."""

# ruff: noqa: F821 -- ADAPTER and CASE are defined in the script, before these

from __future__ import annotations

from typing import Any

from difftest.contracts.batch import POSITIONAL

# what the script defines before these functions (declared here so that this module checks on its own)
ADAPTER: dict[str, Any]
CASE: dict[str, Any]


def _unwrap(module: Any) -> Any:
    """The user's module inside DDP or legacy FSDP (FSDP2 and tensor parallelism keep its class: nothing to unwrap)."""
    while type(module).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel"):
        module = module.module
    return module


def _batch_inputs(data: dict[str, Any], split: str, start: int, stop: int, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """Samples start..stop of the script's batch `split` as the module takes them: (its one input or a tuple of its
    positional ones, its keyword ones), floating tensors in `dtype`."""
    import torch

    def tensor(array: Any) -> Any:
        value = torch.from_numpy(array[start:stop])
        return value.to(dtype) if value.is_floating_point() else value

    prefix = f"{split}.named."
    named = {k[len(prefix):]: tensor(v) for k, v in data.items() if k.startswith(prefix)}
    if not named:
        return tensor(data[f"{split}.dense"]), {}
    positional = tuple(named.pop(f"{POSITIONAL}{i}") for i in range(len(named)) if f"{POSITIONAL}{i}" in named)
    return positional, named


def build_model(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> Any:
    """The user's module from its factory, with the case's weights, its frozen parameters frozen, in `dtype`."""
    import torch

    module = ADAPTER["model"](case["seed"])
    module.load_state_dict({k[len("state."):]: torch.from_numpy(v) for k, v in data.items() if k.startswith("state.")})
    for name, parameter in module.named_parameters():
        if name in case["frozen"]:
            parameter.requires_grad_(False)
    return {torch.float64: module.double, torch.float32: module.float}[dtype]()


def prediction_loss(prediction: Any, labels: Any) -> Any:
    """The adapter's loss of a prediction, its floating target in the prediction's dtype."""
    return ADAPTER["loss"](prediction, labels.to(prediction.dtype) if labels.is_floating_point() else labels)


def model_loss(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> Any:
    """The loss on training samples start..stop, as the adapter's forward (and its `prediction`) and loss compute it."""
    import torch

    inputs, keywords = _batch_inputs(data, "train", start, stop, dtype)
    output = module(*inputs, **keywords) if isinstance(inputs, tuple) else module(inputs, **keywords)
    prediction = ADAPTER["prediction"](output) if "prediction" in ADAPTER else output
    return prediction_loss(prediction, torch.from_numpy(data["train.labels"][start:stop]))


def model_parameters(module: Any) -> dict[str, Any]:
    return dict(_unwrap(module).named_parameters())


def model_tp_plan(module: Any, world_size: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """The model's own tensor-parallel plan, as the adapter's `tp_plan` gives it."""
    plan: dict[str, Any] = ADAPTER["tp_plan"](_unwrap(module), world_size)
    return plan


def model_chain(module: Any, data: dict[str, Any], fed: dict[str, str], dtype: Any) -> list[Any]:
    """The module as pipeline units (the adapter's `chain`, or its `layers` in order), the first reading the inputs
    of the script's batch `fed["split"]` at the positions it is given."""
    import torch

    units = ADAPTER["chain"](module) if "chain" in ADAPTER else [module.get_submodule(n) for n in CASE["layers"]]

    class Fed(torch.nn.Module):
        def __init__(self, unit: Any) -> None:
            super().__init__()
            self.unit = unit

        def forward(self, positions: Any) -> Any:
            start = int(positions[0])
            inputs, keywords = _batch_inputs(data, fed["split"], start, start + len(positions), dtype)
            return self.unit(*inputs, **keywords) if isinstance(inputs, tuple) else self.unit(inputs, **keywords)

    return [Fed(units[0]), *units[1:]]
