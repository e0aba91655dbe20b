"""What every training setting records, and how per-rank pieces become full tensors on rank 0.

Recorded names (phase/tensor):
  eval_before/{prediction,pooled.<feature>}, train_step{i}/loss, param_after_step{i}/<canonical name>, eval_after_step{k}/prediction
Each rank trains on its contiguous share of the same global batch; losses are per-rank means, so the global
loss is the mean over ranks (equal shares) and gradients follow the global-mean convention of the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from difftest import Inputs, Outputs, RunContext, record_training, register_world_reset, to_numpy
from generators.inputs import Batch


def assemble(shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], np.ndarray]], name: str) -> np.ndarray:
    """A full tensor from (offsets, block) pieces; every element must be covered exactly once."""
    full = np.zeros(shape, dtype=pieces[0][1].dtype if pieces else np.float32)
    covered = np.zeros(shape, dtype=np.int32)
    for offsets, block in pieces:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape))
        full[index] = block
        covered[index] += 1
    if not np.all(covered == 1):
        raise RuntimeError(
            f"shards of {name} do not tile it: {int((covered == 0).sum())} elements missing, "
            f"{int((covered > 1).sum())} covered twice"
        )
    return full


def build_for_training(model: Any, device: str, **options: Any) -> Any:
    """The model's PyTorch module; a model without one (its conversion failed) cannot run this setting."""
    from difftest import ConversionFailed, Unsupported

    try:
        return model.build(device, **options)
    except ConversionFailed as exc:  # the conversion settings report it as an error
        raise Unsupported(f"no PyTorch form: {exc}") from None


def sgd_step(model: Any, module: Any, optimizer: Any, batch: Batch, device: str,
             stepping: Callable[[Any], Any] | None = None) -> float:
    """One plain SGD step on `batch`: forward, mean loss, backward, update; returns the loss. The forward and the
    backward run inside `stepping(module)` where a setting gives one (Compiled Autograd's, for instance)."""
    from torch.distributed.tensor import DTensor

    optimizer.zero_grad()
    with stepping(module) if stepping is not None else contextlib.nullcontext():
        loss = model.loss(model.forward(module, batch, device), batch)
        loss.backward()
    optimizer.step()
    # a loss computed on DTensors may be a pending reduction (Partial), whose `item()` is this rank's part alone
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


@dataclass(frozen=True)
class Training:
    """The optimizer a training setting steps: `torch.optim.<cls>` with `options`, its learning rate the run's times
    `lr_scale`; plain SGD by default (what the references train with). A composing setting's other optimizer records
    its state after each step too (`state_reader`)."""

    cls: str = "SGD"
    options: tuple[tuple[str, Any], ...] = ()
    lr_scale: float = 1.0

    @property
    def stateful(self) -> bool:
        return (self.cls, self.options) != ("SGD", ())

    def optimizer(self, module: Any, lr: float) -> Any:
        import torch

        return getattr(torch.optim, self.cls)([p for p in module.parameters() if p.requires_grad],
                                              lr=lr * self.lr_scale, **dict(self.options))

    def state_reader(self, ctx: RunContext, model: Any, module: Any,
                     optimizer: Any) -> Callable[[], dict[str, np.ndarray] | None] | None:
        """What `record_training` records as the optimizer's state (`<parameter>.<state>`, whole; collective for
        DTensors), or None for plain SGD, which keeps none. Named by the PyTorch module's own parameter names (a
        wrapper's prefixes taken off), in PyTorch's layout: a kind's canonical names may be views (a converted
        model's Keras layout), which the optimizer keeps no state for."""
        if not self.stateful:
            return None

        def read() -> dict[str, np.ndarray] | None:
            import torch
            from torch.distributed.tensor import DTensor
            from torch.nn.parallel import DistributedDataParallel

            inner = module.module if isinstance(module, DistributedDataParallel) else module
            state = {}
            for name, parameter in inner.named_parameters():
                name = name.replace("_checkpoint_wrapped_module.", "")
                for key, value in optimizer.state.get(parameter, {}).items():
                    if key != "step" and isinstance(value, torch.Tensor) and value.ndim > 0:
                        state[f"{name}.{key}"] = to_numpy(value.full_tensor() if isinstance(value, DTensor) else value)
            return state if ctx.rank == 0 else None

        return read


class OneProcessRoot:
    """Mixed into a family's root (listed before the family's class): one process, deterministic algorithms, judged
    against itself; one full-batch step per update, so any sample order is as good (its calibration may reorder)."""

    name: str
    deterministic: ClassVar[bool] = True
    sample_order_free: ClassVar[bool] = True

    @property
    def reference(self) -> str:
        return self.name

    @property
    def collectives(self) -> frozenset[str]:
        return frozenset()


def full_parameters(wrapped: Any, read: Any) -> dict[str, Any]:
    """Every tensor `read(wrapped)` names, whole: a DTensor (FSDP2, tensor parallel) all-gathered, so every rank must
    call it; under the name the plain model gives it (without checkpoint_wrapper's `_checkpoint_wrapped_module.`). A
    standalone script of a setting whose parameters are whole or DTensors copies this one."""
    from torch.distributed.tensor import DTensor

    return {name.replace("_checkpoint_wrapped_module.", ""): t.full_tensor() if isinstance(t, DTensor) else t
            for name, t in read(wrapped).items()}


def canonical_parameters(model: Any, module: Any) -> dict[str, np.ndarray]:
    """Every parameter under its canonical name, whole (collective for DTensors: every rank must call it)."""
    return {name: to_numpy(tensor) for name, tensor in full_parameters(module, model.parameters).items()}


def gathered_parameters(ctx: RunContext, model: Any, module: Any) -> dict[str, np.ndarray] | None:
    """`canonical_parameters` on every rank (DTensors gather collectively), kept on rank 0."""
    full = canonical_parameters(model, module)
    return full if ctx.rank == 0 else None


def train_single_process(ctx: RunContext, model: Any, inputs: Inputs, module: Any) -> Outputs | None:
    """Plain SGD on the global batch in this one process: what the references do."""
    import torch

    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=ctx.lr)
    return record_training(
        ctx, inputs, lambda b: model.evaluate(module, b, ctx.device),
        lambda b: sgd_step(model, module, optimizer, b, ctx.device),
        lambda: canonical_parameters(model, module),
    )


def train_data_parallel(ctx: RunContext, model: Any, inputs: Inputs, wrapped: Any,
                        full_parameters: Callable[[], dict[str, np.ndarray] | None],
                        data_shard: tuple[int, int] | None = None,
                        stepping: Callable[[Any], Any] | None = None,
                        training: Training | None = None) -> Outputs | None:
    """Plain SGD (or `training`'s optimizer, its state recorded) on this rank's share through a wrapper that
    synchronises gradients itself (each step's forward and backward inside `stepping(wrapped)`, as `sgd_step`)."""
    training = training or Training()
    optimizer = training.optimizer(wrapped, ctx.lr)
    return record_training(
        ctx, inputs, lambda b: model.evaluate(wrapped, b, ctx.device),
        lambda b: sgd_step(model, wrapped, optimizer, b, ctx.device, stepping), full_parameters, data_shard,
        training.state_reader(ctx, model, wrapped, optimizer),
    )


_WORLD_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}
register_world_reset(_WORLD_MESHES.clear)  # a mesh's groups die with the case's world


def world_mesh(ctx: RunContext, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """An n-D DeviceMesh of `shape` over the case's ranks, made once per world: every rank creates its subgroups in
    step, and a worker's next case in the same world reuses them."""
    if (shape, names) not in _WORLD_MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _WORLD_MESHES[(shape, names)] = init_device_mesh(ctx.device.split(":")[0], shape, mesh_dim_names=names)
    return _WORLD_MESHES[(shape, names)]


def device_mesh(ctx: RunContext, group: Any = None, name: str = "dp") -> Any:
    """A 1-D DeviceMesh over `group` (default: the case's group), reusing it instead of creating new groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group if group is not None else ctx.group, device_type=ctx.device.split(":")[0],
                                 mesh_dim_names=(name,))


def parameter_holders(module: Any) -> list[tuple[str, Any]]:
    """(qualified name, submodule) of every submodule that itself holds a parameter, in module order. A ParameterList
    or ParameterDict is indexed, never called (TorchRec's cross net reads its kernels so): its parameters count as its
    parent's, since a wrapper that hooks a module's forward (FSDP2's unit) would never see it run."""
    from torch import nn

    holders = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ParameterList, nn.ParameterDict)):
            continue
        owned = any(True for _ in m.parameters(recurse=False)) or any(
            isinstance(child, (nn.ParameterList, nn.ParameterDict)) for child in m.children())
        if name and owned:
            holders.append((name, m))
    return holders

