"""ONNX → PyTorch with a choice of converter, made trainable: one trainable parameter per Keras weight.

Converters produce inference modules: onnx2torch keeps even Dense weights as buffers, onnx2pytorch keeps
folded-norm, Embedding and RNN-loop weights as buffers beside an unused duplicate of each weight. So the
mapping is found from the values themselves: every Keras weight was drawn at random, hence the converted
tensor that holds it (in any axis order) is the one whose values equal an axis permutation of it. Among
equal tensors, the one the forward pass reads is found with autograd. That tensor becomes the single
trainable parameter of the weight; every other tensor is frozen. A Keras weight no tensor holds (BatchNorm
gamma folded into a product) is reported, so training comparisons can say `unsupported` instead of lying.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from difftest.errors import ConversionFailed

CONVERTERS = ("onnx2pytorch", "onnx2torch")


def convert_onnx(generator: Any, spec: Any, init_state: dict[str, np.ndarray], model_dir: Path | None,
                 converter: str, device: str) -> Any:
    import onnx

    from generators.sequential import onnx_export

    proto = onnx.load_model(str(onnx_export(model_dir)))
    try:
        graph = _CONVERT[converter](proto)
    except Exception as exc:
        raise ConversionFailed(f"{converter} {type(exc).__name__}: {str(exc)[:500]}") from None
    graph = graph.to(device).float()
    probe = torch.from_numpy(generator.inputs(spec, 12)["eval"].dense).to(device)
    try:
        with torch.no_grad():
            graph(probe)
    except Exception as exc:
        raise ConversionFailed(f"{converter} module fails to run: {type(exc).__name__}: {str(exc)[:500]}") from None
    wanted = {n: v for n, v in init_state.items() if not n.endswith(("moving_mean", "moving_variance"))}
    frozen = tuple(f"{layer}/" for layer in spec.frozen)
    return ConvertedModel(graph, wanted, frozen, probe)


def _onnx2pytorch(proto: Any) -> Any:
    from onnx2pytorch import ConvertModel

    return ConvertModel(proto, experimental=True)


def _onnx2torch(proto: Any) -> Any:
    from onnx2torch import convert

    return convert(proto)


_CONVERT = {"onnx2pytorch": _onnx2pytorch, "onnx2torch": _onnx2torch}


def _slots(root: Any) -> list[tuple[Any, str]]:
    """(owner module, attribute) of every float tensor the module holds, each once."""
    seen, slots = set(), []
    for owner in root.modules():
        for table in (owner._parameters, owner._buffers):
            for attr, tensor in table.items():
                if tensor is None or not tensor.is_floating_point() or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                slots.append((owner, attr))
    return slots


def _layout(weight: np.ndarray, tensor: Any) -> tuple[int, ...] | None:
    """The axis permutation p with tensor.flatten() == transpose(weight, p).flatten(), if there is one."""
    if tensor.numel() != weight.size:
        return None
    flat = tensor.detach().cpu().flatten().numpy()
    for perm in itertools.permutations(range(weight.ndim)):
        if np.array_equal(np.transpose(weight, perm).ravel(), flat):
            return perm
    return None


class _Mapped:
    __slots__ = ("owner", "attr", "perm")

    def __init__(self, owner: Any, attr: str, perm: tuple[int, ...]) -> None:
        self.owner, self.attr, self.perm = owner, attr, perm

    @property
    def tensor(self) -> Any:
        return getattr(self.owner, self.attr)


def _make_parameter(owner: Any, attr: str) -> Any:
    if attr in owner._parameters:
        return owner._parameters[attr]
    tensor = owner._buffers.pop(attr)
    parameter = torch.nn.Parameter(tensor.detach().clone())
    owner.register_parameter(attr, parameter)
    return parameter


class ConvertedModel(torch.nn.Module):
    """A converted ONNX graph whose trainable parameters are exactly the mapped Keras weights."""

    def __init__(self, graph: Any, keras_weights: dict[str, np.ndarray], frozen: tuple[str, ...], probe: Any) -> None:
        super().__init__()
        self.graph = graph
        self.keras_shapes = {name: weight.shape for name, weight in keras_weights.items()}
        self.mapped: dict[str, _Mapped] = {}
        self.unmapped: dict[str, str] = {}
        candidates: dict[str, list[tuple[Any, str, tuple[int, ...]]]] = {}
        for owner, attr in _slots(graph):
            for name, weight in keras_weights.items():
                perm = _layout(weight, getattr(owner, attr))
                if perm is not None:
                    candidates.setdefault(name, []).append((owner, attr, perm))
        for parameter in graph.parameters():
            parameter.requires_grad_(False)
        # promote every candidate, then keep the ones the forward pass actually reads
        promoted = {(id(o), a): _make_parameter(o, a) for found in candidates.values() for o, a, _ in found}
        for parameter in promoted.values():
            parameter.requires_grad_(True)
        graph(probe).float().square().sum().backward()
        for name in keras_weights:
            found = candidates.get(name, [])
            used = [c for c in found if promoted[(id(c[0]), c[1])].grad is not None]
            if len(used) == 1:
                self.mapped[name] = _Mapped(*used[0])
            elif not found:
                self.unmapped[name] = "no tensor of the converted module holds it (folded into another constant)"
            elif not used:
                self.unmapped[name] = "held only by tensors the forward pass does not read"
            else:
                self.unmapped[name] = f"read from {len(used)} separate tensors, which would train apart"
        for parameter in promoted.values():
            parameter.grad = None
            parameter.requires_grad_(False)
        for name, mapped in self.mapped.items():
            mapped.tensor.requires_grad_(not name.startswith(frozen))

    def forward(self, x: Any) -> Any:
        return self.graph(x)

    def keras_parameters(self) -> dict[str, Any]:
        """Keras name → the mapped parameter, viewed in Keras layout."""
        views = {}
        from torch.distributed.tensor import DTensor

        for name, mapped in self.mapped.items():
            tensor = mapped.tensor
            if isinstance(tensor, DTensor):  # sharded (FSDP2, tensor parallel): read the whole tensor
                tensor = tensor.full_tensor()
            transposed_shape = tuple(self.keras_shapes[name][p] for p in mapped.perm)
            inverse = np.argsort(mapped.perm).tolist()
            views[name] = tensor.reshape(transposed_shape).permute(*inverse)
        return views
