"""Tensor parallelism applied as the setting applies it, and as a standalone script copies it (these functions as they
are): the plan's styles over a 1-D mesh (`distribute`), DTensor outputs and gradients made whole where the program
needs plain tensors, loss parallel's backward."""

# ruff: noqa: F821 -- `distribute` and `backward_on_share` call a kind's own `model_tp_plan` and `model_loss`, which a
# standalone script of its model defines, and `checkpointed`, which a checkpointed setting's script copies

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# a kind's own plan, which a standalone script of its model defines (declared here so that this module checks on its own)
model_tp_plan: Callable[..., dict[str, Any]]
model_loss: Callable[..., Any]
checkpointed: Callable[..., Any]  # an activation-checkpointed setting's script copies it (settings.activation_checkpointing)


def parallel_style(spec: dict[str, Any]) -> Any:
    """ColwiseParallel keeping its output a DTensor, or RowwiseParallel: all-reduced to a replicated plain tensor, or
    with `shard_dim` (sequence parallel) reduce-scattered onto the positions, kept a DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if spec["style"] == "colwise":
        return ColwiseParallel(use_local_output=False)
    if spec["shard_dim"] is not None:
        return RowwiseParallel(output_layouts=Shard(spec["shard_dim"]), use_local_output=False)
    return RowwiseParallel(output_layouts=Replicate(), use_local_output=True)


def keep_dtensor_activations(plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with every ColwiseParallel's output kept a DTensor (`use_local_output=False`): what runs between a
    column-wise and a row-wise layer (attention's views, rotary slices and concatenation, head repetition, the
    attention itself, a gated activation) runs on DTensors under DTensor's sharding rules, uneven shards included,
    and the row-wise layer takes the DTensor as it is. The remedy pytorch#150336 proposes for uneven widths."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for style in plan.values():
        if isinstance(style, ColwiseParallel):
            style.use_local_output = False
    return plan


def whole_outputs_and_gradients(module: Any, keep_sharded: Any = lambda: False) -> None:
    """A sharded tensor reaching the model's output is handed back whole (unless `keep_sharded()`: to a loss-parallel
    loss), and a parameter outside the plan that met a DTensor activation gets its gradient whole, not a replicated
    DTensor an optimizer cannot add to it."""
    from torch.distributed.tensor import DTensor

    def whole_gradient(parameter: Any) -> None:
        if isinstance(parameter.grad, DTensor):
            parameter.grad = parameter.grad.full_tensor()

    module.register_forward_hook(lambda _m, _a, out: out.full_tensor()
                                 if isinstance(out, DTensor) and not keep_sharded() else out)
    for parameter in module.parameters():
        if parameter.requires_grad and not isinstance(parameter, DTensor):
            parameter.register_post_accumulate_grad_hook(whole_gradient)


def stepping(module: Any) -> Any:
    """Plain constants in a converted graph meet DTensor activations: replicated implicitly while the model steps."""
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def distribute(module: Any, group: Any, device: str, setting: dict[str, Any]) -> Any:
    """Tensor parallel over `group` with the plan (module name → `parallel_style`'s spec), as the setting applies it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh.from_group(group, device_type=device.split(":")[0], mesh_dim_names=("tp",))
    own = model_tp_plan(module, *setting["own_plan"]) if "own_plan" in setting else None
    if own is not None and setting.get("dtensor_activations"):
        own = keep_dtensor_activations(own)
    parallelize_module(module, mesh, own if own is not None else
                       {name: parallel_style(spec) for name, spec in setting["plan"].items()})
    if "checkpointed" in setting:  # an activation-checkpointed setting's: its blocks wrapped once the plan is applied
        checkpointed(module, setting["checkpointed"], setting["checkpoint_mode"])
    if "compiled" in setting:  # a compiled setting's: its units compiled once the plan is applied
        compile_units(module, setting["compiled"])
    # a script only trains: a loss-parallel model hands its loss the logits sharded, as the setting's training does
    whole_outputs_and_gradients(module, keep_sharded=lambda: setting.get("loss_parallel", False))
    return module


def compile_units(module: Any, names: list[str]) -> None:
    """Each named submodule of a tensor-parallel module compiled in place (`nn.Module.compile`, Inductor), as
    torchtitan compiles its blocks after applying the plan; "" names the whole module."""
    for name in names:
        module.get_submodule(name).compile()


def backward_on_share(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> None:
    """Loss parallel's gradients of training samples start..stop: the cross-entropy on the vocabulary-sharded logits
    under `loss_parallel()`, inside `stepping` as every tensor-parallel step."""
    from torch.distributed.tensor.parallel import loss_parallel

    with stepping(module), loss_parallel():
        model_loss(module, data, start, stop, dtype).backward()
