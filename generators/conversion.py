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

import functools
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from difftest import ConversionFailed


def convert_onnx(generator: Any, spec: Any, init_state: dict[str, np.ndarray], model_dir: Path | None,
                 converter: str, device: str) -> Any:
    import onnx

    from generators.onnx_files import onnx_export

    proto = onnx.load_model(str(onnx_export(model_dir)))
    layers = _expose_layer_outputs(proto, [layer["name"] for layer in spec.params["layers"]])
    try:
        graph = convert_graph(proto, converter)
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
    converted = ConvertedModel(graph, wanted, frozen, probe, layers)
    converted.probe = probe
    return converted


def _expose_layer_outputs(proto: Any, layer_names: list[str]) -> list[str]:
    """Make the tensor at each Keras layer boundary (`layer_cuts`) an output of the graph too, so that evaluation
    records every layer's activation and a finding names the layer it starts in. Returns the layers, in the order
    of the outputs that follow the logits."""
    import onnx

    try:
        cuts = layer_cuts(onnx.shape_inference.infer_shapes(proto))
    except Exception:  # a graph shape inference cannot type has no cuts to expose: the logits alone are recorded
        return []
    exposed: list[str] = []
    for cut in cuts:
        onnx_layer = _layer_of(cut)  # "l3_dense_1": Keras may suffix the name inside its function graph
        matches = [n for n in layer_names if onnx_layer == n or onnx_layer.startswith(f"{n}_")]
        if not matches or max(matches, key=len) in exposed:
            continue
        exposed.append(max(matches, key=len))
        proto.graph.output.append(onnx.helper.make_tensor_value_info(cut, onnx.TensorProto.FLOAT, None))
    return exposed


def convert_graph(proto: Any, converter: str) -> Any:
    """The ONNX model as a PyTorch module, by onnx2pytorch or onnx2torch."""
    if converter == "onnx2pytorch":
        from onnx2pytorch import ConvertModel

        return ConvertModel(proto, experimental=True)
    from onnx2torch import convert

    return convert(proto)


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
    __slots__ = ("attr", "owner", "perm")

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

    def __init__(self, graph: Any, keras_weights: dict[str, np.ndarray], frozen: tuple[str, ...], probe: Any,
                 layers: list[str] | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.layers = list(layers or [])  # the Keras layers whose outputs the graph returns after the logits
        self.captured: dict[str, Any] | None = None  # set by `SequentialGenerator.evaluate` to record them
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
        reached = self.forward(probe).float()
        if reached.requires_grad:  # a graph segment may hold no weight at all
            reached.square().sum().backward()
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
        out = self.graph(x)
        if not isinstance(out, (list, tuple)):
            return out
        if self.captured is not None:
            self.captured.update(zip(self.layers, out[1:]))
        return out[0]

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


def layer_cuts(proto: Any) -> list[str]:
    """In a shape-inferred ONNX model: float tensors through which alone the graph passes from one Keras layer to the next, in graph order.

    A cut is a point in the (topologically ordered) node list where exactly one tensor computed from the
    input is still needed later: the graph splits there into two graphs joined by that tensor. Tensors
    computed from constants alone are not counted (both sides can recompute them); tensors a Loop body reads
    from the outer graph count as read by the Loop. Of several cuts inside one Keras layer only the last is
    kept, so stages hold whole layers.
    """
    import onnx

    graph = proto.graph
    types = {v.name: v.type.tensor_type.elem_type for v in graph.value_info}
    constant = {i.name for i in graph.initializer}
    last_use: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        reads = set(node.input) | _outer_reads(node)
        if reads <= constant | {""}:
            constant.update(node.output)
        for name in reads:
            last_use[name] = k
    outputs = {o.name for o in graph.output}
    live = {i.name for i in graph.input}
    cuts: list[str] = []
    for k, node in enumerate(graph.node[:-1]):
        live.update(o for o in node.output if o not in constant)
        live = {t for t in live if last_use.get(t, -1) > k or t in outputs}
        if len(live) == 1:
            (tensor,) = live
            if tensor not in outputs and types.get(tensor) == onnx.TensorProto.FLOAT and tensor not in cuts:
                cuts.append(tensor)
    # the graph's output is often a bare "Identity:0": the last layer is that of the last named node
    final = next((_layer_of(f"{n.name}:0") for n in reversed(graph.node) if n.name.count("/") >= 2), None)
    layer = [_layer_of(c) for c in cuts] + [final]
    return [c for i, c in enumerate(cuts) if layer[i] != layer[i + 1]]


def _outer_reads(node: Any) -> set[str]:
    names: set[str] = set()
    for attribute in node.attribute:
        for subgraph in list(attribute.g.node and [attribute.g]) + list(attribute.graphs):
            for inner in subgraph.node:
                names.update(inner.input)
                names |= _outer_reads(inner)
    return names


def _layer_of(tensor: str) -> str:
    parts = tensor.split("/")
    return parts[1] if len(parts) > 2 else tensor  # "seq_1/l3_dense_1/MatMul:0" -> "l3_dense_1"


def convert_chain(generator: Any, spec: Any, init_state: dict[str, np.ndarray], model_dir: Path | None,
                  converter: str, device: str) -> Any:
    """The converted model as a LayerChain: one unit per ONNX segment between consecutive layer cuts."""
    import onnx

    from difftest import BatchSource, LayerChain
    from generators.onnx_files import onnx_export

    whole = convert_onnx(generator, spec, init_state, model_dir, converter, device)
    proto = onnx.shape_inference.infer_shapes(onnx.load_model(str(onnx_export(model_dir))))
    cuts = layer_cuts(proto)
    ends = [proto.graph.input[0].name, *cuts, proto.graph.output[0].name]
    extractor = onnx.utils.Extractor(proto)
    wanted = {n: v for n, v in init_state.items() if n in whole.keras_shapes}
    frozen = tuple(f"{layer}/" for layer in spec.frozen)
    probe = whole.probe
    segments = []
    for start, stop in zip(ends, ends[1:]):
        part = extractor.extract_model([start], [stop])
        try:
            graph = convert_graph(part, converter).to(device).float()
            segment = ConvertedModel(graph, wanted, frozen, probe)
        except Exception as exc:
            raise ConversionFailed(f"{converter} on the segment {start} -> {stop}: {type(exc).__name__}: "
                                   f"{str(exc)[:300]}") from None
        with torch.no_grad():
            probe = graph(probe)
        segments.append(segment)
    owners: dict[str, int] = {}
    for i, segment in enumerate(segments):
        for name in segment.mapped:
            owners.setdefault(name, i)
    if set(owners) != set(whole.mapped):
        raise ConversionFailed(f"cutting at layer boundaries loses the mapping of "
                               f"{sorted(set(whole.mapped) ^ set(owners))}")
    source = BatchSource()
    units = [_InputSegment(source, segments[0], device), *segments[1:]]
    # a partial, not a closure: a deep copy of the chain (`LoadedModel.chain`) reads its own segments
    return LayerChain(units, source, functools.partial(_keras_parameters, segments), "logits")


def _keras_parameters(segments: list[ConvertedModel]) -> dict[str, Any]:
    return {n: t for s in segments for n, t in s.keras_parameters().items()}


class _InputSegment(torch.nn.Module):
    """The first unit: reads the samples at the given positions and runs the first segment on them."""

    def __init__(self, source: Any, segment: Any, device: str) -> None:
        super().__init__()
        self.source, self.segment, self.device = source, segment, device

    def forward(self, positions: Any) -> Any:
        return self.segment(torch.from_numpy(self.source.samples(positions).dense).to(self.device))


# --- the converted model in a standalone script (difftest.scripts.emit) ------------------------------------------------
def build_model(data: dict[str, Any], case: dict[str, Any], dtype: Any) -> Any:
    """The converted model with one trainable parameter per Keras weight, from the script's data (the exported ONNX
    graph, the Keras weights, the probe batch), as `convert_onnx` builds it; in `dtype`."""
    import onnx

    graph = convert_graph(onnx.load_model_from_string(data["onnx"].tobytes()), case["converter"]).float()
    weights = {name[len("weight."):]: value for name, value in data.items() if name.startswith("weight.")}
    model = ConvertedModel(graph, weights, tuple(case["frozen"]), torch.from_numpy(data["probe"]))
    return model.to(dtype)


def converted_model_code(spec: Any, init_state: dict[str, np.ndarray], model_dir: Path | None, probe: np.ndarray,
                         kind_functions: tuple[Any, ...], data: dict[str, np.ndarray]) -> Any:
    """A converted Keras model's `ModelCode`: the exported graph and the Keras weights as data, the converter and the
    trainable mapping as `convert_onnx` runs them, and the kind's own loss and parameter reading (`kind_functions`)."""
    import onnx

    from difftest import ModelCode

    graph, made_by = shipped_export(model_dir)
    converter = spec.params["converter"]
    weights = {n: v for n, v in init_state.items() if not n.endswith(("moving_mean", "moving_variance"))}
    return ModelCode(
        summary=f"The model is the ONNX graph tf2onnx (opset 18) exported from a Keras model ({made_by}), converted "
                f"to PyTorch by {converter}, with one trainable parameter per Keras weight (ONNX {onnx.__version__}; "
                "the graph is the script's data: TensorFlow is not needed).",
        libraries=("onnx", converter), preamble=("import itertools",),
        functions=(convert_graph, _slots, _layout, _Mapped, _make_parameter, ConvertedModel, build_model,
                   *kind_functions),
        case={"converter": converter, "frozen": [f"{layer}/" for layer in spec.frozen]},
        data={"onnx": graph, "probe": probe, **data,
              **{f"weight.{name}": value for name, value in weights.items()}},
        parameters=tuple(weights))


def shipped_export(model_dir: Path | None) -> tuple[np.ndarray, str]:
    """The model's exported ONNX graph as a standalone script's data (its bytes), and the releases that made it;
    `Unsupported` where the export failed."""
    from difftest import Unsupported
    from difftest import current_stack as current
    from generators.onnx_files import onnx_export

    try:
        graph = onnx_export(model_dir).read_bytes()
    except (ConversionFailed, OSError) as exc:
        raise Unsupported(f"no ONNX export to ship with the script ({exc})") from None
    made_by = ", ".join(f"{name} {version}" for name, version in current()["libraries"].items()
                        if name in ("tf2onnx", "tensorflow", "tensorflow-cpu", "keras"))
    return np.frombuffer(graph, dtype=np.uint8), made_by
