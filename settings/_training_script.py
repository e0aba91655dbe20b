"""A training setting's standalone script (`difftest.scripts.emit`): what `training_script` assembles, and the functions
copied into it beside the model's (`Generator.standalone_model`: `build_model`, `model_loss`, `model_parameters`) and
the setting's (`distribute`, `full_parameters`), which the script defines before these. The steps are those
`settings._training.record_training` takes: plain SGD, each rank (or group of ranks) on its contiguous share."""

# ruff: noqa: F821 -- the model's and the setting's functions are defined in the script, before these

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from difftest import to_numpy

if TYPE_CHECKING:
    from difftest import ModelCode, Script, StandaloneCase

# what the script defines before these functions (declared here so that this module checks on its own)
build_model: Callable[..., Any]
model_loss: Callable[..., Any]
model_parameters: Callable[..., dict[str, Any]]
distribute: Callable[..., Any]
full_parameters: Callable[..., Any]


def training_script(case: StandaloneCase, summary: str, world_size: int, setting_functions: tuple[Any, ...],
                    setting: dict[str, Any], libraries: tuple[str, ...] = (), optimizer: str = "plain SGD") -> Script:
    """The script of a training setting's disagreement: the model as its kind builds it (`Generator.standalone_model`),
    as many steps of plain SGD as it took to diverge, on the whole batch in one process against the same steps through
    the setting's wrapper, each rank on its share of the batch; it compares the parameters after them.
    `setting_functions` are the setting's own, among them `distribute(module, group, device, setting)` (the
    module wrapped), `full_parameters(wrapped, read)` (every tensor `read(wrapped)` names, whole) and, where the steps
    run inside a context, `stepping(module)`, where a step takes its share's gradients otherwise than in one
    backward pass, `backward_on_share(module, data, start, stop, dtype)`, or where the steps are not plain SGD,
    `sgd_on_share(module, data, case, rank, world_size, dtype)`. `setting["data_parallel"]`: how many
    shares the batch is cut into (default: one per rank); `setting["optimizer"]`: the optimizer in place of plain SGD
    (`sgd_on_share` says how), `optimizer` its words in the summary."""
    from difftest import Script

    own = {f.__name__ for f in setting_functions}  # a setting's own step or context replaces the plain one
    train = case.inputs["train"]
    model, steps, tensors = trained_parameters(case)
    shares = setting.get("data_parallel", world_size)
    fed = ("each on its contiguous share of the batch" if shares == world_size else "every rank on the whole batch"
           if shares == 1 else f"each of {shares} groups of ranks on its contiguous share of the batch")
    return Script(
        summary=f"{summary}, {steps} step(s) of {optimizer} (lr {setting.get('optimizer', {}).get('lr', case.lr):g}) "
                f"over {world_size} CPU ranks (gloo), "
                f"{fed}" + case.against("the same steps on the whole batch in one process: the parameters after "
                                        "them") + f". {model.summary}",
        libraries=("torch", *model.libraries, *libraries, "numpy"),
        preamble=model.preamble,
        case={**model.case, "setting": setting, "device": "cpu", "lr": case.lr, "steps": steps,
              "batch": train.size},
        functions=(*model.functions, *setting_functions, to_numpy,
                   *(f for f in (sgd_on_share, backward_on_share, stepping) if f.__name__ not in own),
                   parameters_after, single_process, on_rank),
        tensors=tensors, data=model.data, world_size=world_size)


def trained_parameters(case: StandaloneCase) -> tuple[ModelCode, int, dict[str, str]]:
    """What a training setting's script compares: the model's code (`Generator.standalone_model`), the steps it takes
    (as many as the case took to diverge; a failure's, the run's, failing on the way) and the parameters after them,
    "param_after_step<N>/<name>" each (every one the envelope measured; without one, judged by allclose, every one: a
    minimal case's model may no longer hold the tensor the finding's example first diverged at)."""
    import re

    from difftest import Unsupported

    # an optimizer's state diverges with the weights it moves in that step, and a step's loss with the gradients it
    # gives (per-rank BatchNorm statistics, a loss that sums): the script compares the weights after that step
    step = re.match(r"(?:param|state)_after_step(\d+)/|train_step(\d+)/loss$", case.first_divergence)
    if not case.failure and step is None:
        raise Unsupported(f"it first diverges at {case.first_divergence}, not at a parameter (or an optimizer's state) "
                          "after a training step, a step's loss or by failing, which is what a training script shows")
    model = case.generator.standalone_model(case.spec, case.init_state, case.model_dir, case.inputs["train"])
    if model is None:
        raise Unsupported(f"{case.spec.kind} models have no standalone form (Generator.standalone_model)")
    steps = int(step[1] or step[2]) if step else case.steps
    phase = f"param_after_step{steps}"
    names = [n for n in model.parameters if f"{phase}/{n}" in case.spread] or list(model.parameters)
    return model, steps, {f"{phase}/{n}": f"{phase}/{n}" for n in names}


def sgd_on_share(module: Any, data: dict[str, Any], case: dict[str, Any], rank: int, world_size: int,
                 dtype: Any) -> None:
    """`case["steps"]` steps of plain SGD (or the setting's `optimizer`: a torch.optim class, its options and learning
    rate) on this rank's contiguous share of the training batch."""
    import torch

    optimizer = case["setting"].get("optimizer", {"cls": "SGD", "options": {}, "lr": case["lr"]})
    optimizer = getattr(torch.optim, optimizer["cls"])([p for p in module.parameters() if p.requires_grad],
                                                       lr=optimizer["lr"], **optimizer["options"])
    # the ranks of a tensor-parallel group share one; the single process (world_size 1) takes the whole batch
    shares = min(case["setting"].get("data_parallel", world_size), world_size)
    share, index = case["batch"] // shares, rank // (world_size // shares)
    for _ in range(case["steps"]):
        optimizer.zero_grad()
        backward_on_share(module, data, index * share, (index + 1) * share, dtype)
        with stepping(module):  # as the setting steps (tensor parallel's implicit replication)
            optimizer.step()


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """The gradients of training samples start..stop: one backward pass of their mean loss."""
    with stepping(module):
        model_loss(module, data, start, stop, dtype).backward()


def stepping(module: Any) -> Any:
    """What the steps run inside: nothing, unless the setting says otherwise (its own `stepping`)."""
    import contextlib

    return contextlib.nullcontext()


def parameters_after(tensors: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray]:
    return {f"param_after_step{case['steps']}/{name}": to_numpy(value) for name, value in tensors.items()}


def single_process(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> dict[str, np.ndarray]:
    """The reference: the steps on the whole batch in one process, in `dtype`."""
    module = build_model(data, case, dtype)
    sgd_on_share(module, data, case, 0, 1, dtype)
    return parameters_after(model_parameters(module), case)


def on_rank(rank: int, world_size: int, data: dict[str, Any], case: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The setting: the model wrapped as the setting wraps it, each rank training on its share."""
    import torch
    import torch.distributed as dist

    wrapped = distribute(build_model(data, case, torch.float32), dist.group.WORLD, case["device"], case["setting"])
    sgd_on_share(wrapped, data, case, rank, world_size, torch.float32)
    whole = full_parameters(wrapped, model_parameters)  # collective: every rank takes part
    return parameters_after(whole, case) if rank == 0 else None
