"""Keras functional models: Muffin's cell-based DAGs (`keras-dag`) and transformer encoder/decoder blocks
(`keras-transformer`), materialised like the `sequential` kind (TensorFlow, tf2onnx → PyTorch, the same conversion
checks and weight mapping).

A spec's `layers` are the graph's nodes in topological order; each names the nodes it reads (`inputs`, "input" for
the model's input). A DAG is a chain of cells: each cell runs two branches from the cell's input — shape-preserving
layers (Dense, Conv with same padding, normalisation, activation, dropout) ending at a common width — joins them with
a merge (Add, Subtract, Multiply, Average, Concatenate), and may add the cell's input back (a residual connection).
Between cells one layer of the sequential catalogue may reshape the stream. Where exactly one tensor crosses from one
part of the graph to the rest (between cells), the ONNX graph has a cut, and pipelines split there.

A transformer block is Keras's own layers: LayerNormalization, MultiHeadAttention (with or without a causal mask),
residual Adds, a feed-forward Dense pair with gelu or swish; tokens are embedded and learned position embeddings added
(positions counted along the input, see `assemble`). The prediction is a
classifier over the mean of the positions, so labels and loss are the `sequential` kind's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from difftest import ModelSpec, register_generator
from generators.sequential import (
    ACTIVATIONS,
    DEFAULT_CONVERTER,
    SequentialGenerator,
    _candidates,
    _keras_layer,
    _pick,
    _rng,
)

MERGES = ("Add", "Subtract", "Multiply", "Average", "Concatenate")


def _branch_layer(rng: np.random.Generator, shape: tuple) -> dict:
    """A layer that keeps every dim but the last (so two branches stay mergeable)."""
    choices = ["Dense", "Activation", "LayerNormalization", "BatchNormalization", "Dropout"]
    if len(shape) == 2:
        choices.append("Conv1D")
    if len(shape) == 3:
        choices.append("Conv2D")
    kind = _pick(rng, choices)
    if kind == "Dense":
        return {"class": "Dense", "units": int(rng.integers(2, 13)), "activation": _pick(rng, (None,) + ACTIVATIONS)}
    if kind == "Activation":
        return {"class": "Activation", "activation": _pick(rng, ACTIVATIONS)}
    if kind == "Dropout":
        return {"class": "Dropout", "rate": round(float(rng.uniform(0.1, 0.5)), 2)}
    if kind in ("Conv1D", "Conv2D"):
        return {"class": kind, "filters": int(rng.integers(2, 9)), "kernel_size": int(rng.integers(1, 4)),
                "padding": "same", "activation": _pick(rng, (None,) + ACTIVATIONS)}
    return {"class": kind}


def _width(layer: dict, width: int) -> int:
    return layer.get("units") or layer.get("filters") or width


class _Graph:
    """Nodes appended in topological order, named `l<i>_<class>` as the sequential kind names its layers."""

    def __init__(self) -> None:
        self.layers: list[dict] = []

    def add(self, layer: dict, *inputs: str) -> str:
        layer = {**layer, "inputs": list(inputs), "name": f"l{len(self.layers)}_{layer['class'].lower()}"}
        self.layers.append(layer)
        return layer["name"]


def _draw_dag(rng: np.random.Generator) -> tuple[dict, list[dict], int]:
    form = _pick(rng, ("flat", "sequence", "image"))
    if form == "flat":
        shape: tuple = (int(rng.integers(4, 17)),)
    elif form == "sequence":
        shape = (int(rng.integers(4, 9)), int(rng.integers(2, 7)))
    else:
        side = int(rng.integers(5, 9))
        shape = (side, side, int(rng.integers(1, 4)))
    source = {"form": form, "shape": list(shape)}
    graph, stream = _Graph(), "input"
    for _ in range(int(rng.integers(2, 4))):
        width, ends = shape[-1], []
        merge = _pick(rng, MERGES)
        common = int(rng.integers(2, 13))  # the width both branches end at (a Concatenate lets them differ)
        for _branch in range(2):
            node, branch_width = stream, width
            for _layer in range(int(rng.integers(1, 3))):
                layer = _branch_layer(rng, shape)
                node = graph.add(layer, node)
                branch_width = _width(layer, branch_width)
            if merge != "Concatenate" and branch_width != common:
                node = graph.add({"class": "Dense", "units": common, "activation": None}, node)
                branch_width = common
            ends.append((node, branch_width))
        out = graph.add({"class": merge}, *(node for node, _ in ends))
        out_width = sum(w for _, w in ends) if merge == "Concatenate" else common
        if out_width == width and rng.random() < 0.6:  # a residual connection around the cell
            out = graph.add({"class": "Add"}, stream, out)
        shape, stream = shape[:-1] + (out_width,), out
        if rng.random() < 0.4:  # one layer of the sequential catalogue between cells may reshape the stream
            layer, new_shape = _pick(rng, _candidates(shape))(rng, shape)
            if layer["class"] == "Dense":
                new_shape = new_shape[:-1] + (layer["units"],)
            if math.prod(new_shape) <= 4096 and min(new_shape) >= 1:
                stream, shape = graph.add(layer, stream), new_shape
    if len(shape) > 1:
        stream = graph.add({"class": "Flatten"}, stream)
    classes = int(rng.integers(2, 6))
    graph.add({"class": "Dense", "units": classes, "activation": None}, stream)
    return source, graph.layers, classes


def _draw_transformer(rng: np.random.Generator) -> tuple[dict, list[dict], int]:
    length, vocab = int(_pick(rng, (4, 8))), int(rng.integers(8, 33))
    heads, key_dim = int(_pick(rng, (2, 4))), int(_pick(rng, (2, 4)))
    dim = heads * key_dim
    source = {"form": "tokens", "shape": [length], "vocab": vocab}
    graph = _Graph()
    tokens = graph.add({"class": "Embedding", "input_dim": vocab, "output_dim": dim}, "input")
    positions = graph.add({"class": "Embedding", "input_dim": length, "output_dim": dim, "call": "positions"}, "input")
    stream = graph.add({"class": "Add"}, tokens, positions)
    causal = bool(rng.random() < 0.5)  # a decoder block masks later positions, an encoder block does not
    activation = _pick(rng, ("gelu", "swish"))
    for _ in range(int(rng.integers(1, 3))):
        normed = graph.add({"class": "LayerNormalization"}, stream)
        attended = graph.add({"class": "MultiHeadAttention", "num_heads": heads, "key_dim": key_dim,
                              "use_causal_mask": causal}, normed)
        stream = graph.add({"class": "Add"}, stream, attended)
        normed = graph.add({"class": "LayerNormalization"}, stream)
        hidden = graph.add({"class": "Dense", "units": int(4 * rng.integers(2, 7)), "activation": activation}, normed)
        projected = graph.add({"class": "Dense", "units": dim, "activation": None}, hidden)
        stream = graph.add({"class": "Add"}, stream, projected)
    stream = graph.add({"class": "LayerNormalization"}, stream)
    pooled = graph.add({"class": "GlobalAveragePooling1D"}, stream)
    classes = int(rng.integers(2, 6))
    graph.add({"class": "Dense", "units": classes, "activation": None}, pooled)
    return source, graph.layers, classes


class FunctionalGenerator(SequentialGenerator):
    """A Keras functional model; everything past building the Keras graph is the sequential kind's."""

    def __init__(self, kind: str, draw: Any, traits: frozenset[str]) -> None:
        self.kind = kind
        self._draw = draw
        self.traits = traits

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = _rng(seed, index, sum(map(ord, self.kind)))
        source, layers, classes = self._draw(rng)
        for layer in layers:  # exact gelu exports as Erfc, the tanh form does not: draw both
            if layer.get("activation") == "gelu":
                layer["gelu_approximate"] = bool(rng.random() < 0.5)
        frozen: tuple[str, ...] = ()
        if index % 2 == 1:  # freeze one weighted layer, never the last
            weighted = [l["name"] for l in layers[:-1] if l["class"] in _WEIGHTED]
            frozen = (_pick(rng, weighted),) if weighted else ()
        params = {"input": source, "layers": layers, "classes": classes, "converter": DEFAULT_CONVERTER}
        return ModelSpec(kind=self.kind, seed=seed, index=index, params=params, frozen=frozen, input_seed=0)

    def assemble(self, keras: Any, spec: ModelSpec, model_input: Any) -> Any:
        built = {layer["name"]: _keras_layer(keras, layer) for layer in spec.params["layers"]}
        output = self._through_graph(keras, spec, built, model_input)
        return keras.Model(model_input, output, name="seq")

    def layer_by_layer(self, keras: Any, spec: ModelSpec, model: Any, x: Any, visit: Any) -> Any:
        layers = {layer["name"]: model.get_layer(layer["name"]) for layer in spec.params["layers"]}
        return self._through_graph(keras, spec, layers, x, visit)

    @staticmethod
    def _through_graph(keras: Any, spec: ModelSpec, layers: dict[str, Any], x: Any, visit: Any = None) -> Any:
        """The graph's output on `x`, calling each node's layer on what it reads (`visit(layer, value)` sees, and may
        replace, each value a layer reads)."""
        tensors = {"input": x}
        for node in spec.params["layers"]:
            layer = layers[node["name"]]
            args = [tensors[name] if visit is None else visit(layer, tensors[name]) for name in node["inputs"]]
            if node["class"] in MERGES:
                tensors[node["name"]] = layer(args)
            elif node["class"] == "MultiHeadAttention":  # self-attention: query = value = key
                tensors[node["name"]] = layer(args[0], args[0], use_causal_mask=node["use_causal_mask"])
            elif node.get("call") == "positions":
                # cumsum, not zeros_like + arange: tf2onnx leaves arange's constant as a graph input
                # (repros/tf2onnx_captured_constant_input.py)
                tensors[node["name"]] = layer(keras.ops.cumsum(keras.ops.ones_like(args[0]), axis=1) - 1)
            else:
                tensors[node["name"]] = layer(args[0], training=False) if visit is not None else layer(args[0])
        return tensors[spec.params["layers"][-1]["name"]]

    def features(self, spec: ModelSpec) -> list[str]:
        kinds = set(super().features(spec))
        for layer in spec.params["layers"]:
            if layer["class"] == "MultiHeadAttention":
                kinds.add("MultiHeadAttention~causal" if layer["use_causal_mask"] else "MultiHeadAttention~bidirectional")
        if any(l["class"] == "Add" and "input" not in l["inputs"] and _is_residual(spec.params["layers"], l)
               for l in spec.params["layers"]):
            kinds.add("Residual")
        return sorted(kinds)

    # --- minimisation: a node bypassed (its readers read its input), a layer narrowed ------------------------
    def size(self, spec: ModelSpec) -> dict[str, int]:
        layers = spec.params["layers"]
        return {"layers": len(layers), "width": sum(l.get("units") or l.get("filters") or 0 for l in layers)}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        """Each single-input node but the logits bypassed; each merge replaced by its first input; each layer 2 wide.
        Some break the shapes of later layers; Keras refuses those and the minimiser drops them."""
        p = spec.params
        layers = p["layers"]
        out: list[tuple[str, dict[str, Any]]] = []
        for i, layer in enumerate(layers[:-1]):
            if layer["class"] == "Embedding":
                continue  # token ids must be embedded
            replacement = layer["inputs"][0]
            kept = [dict(l, inputs=[replacement if n == layer["name"] else n for n in l["inputs"]])
                    for j, l in enumerate(layers) if j != i]
            out.append((f"bypass {layer['name']}", {**p, "layers": kept}))
        for i, layer in enumerate(layers[:-1]):
            for key in ("units", "filters"):
                if layer.get(key, 0) > 2:
                    out.append((f"layer {layer['name']} 2 wide",
                                {**p, "layers": layers[:i] + [{**layer, key: 2}] + layers[i + 1:]}))
        return out


_WEIGHTED = {"Dense", "Conv1D", "Conv2D", "LayerNormalization", "BatchNormalization", "Embedding", "MultiHeadAttention"}


def _is_residual(layers: list[dict], add: dict) -> bool:
    """An Add one of whose inputs is also read by an earlier node (it skips over them)."""
    names = [l["name"] for l in layers]
    position = names.index(add["name"])
    return any(source in l["inputs"] for source in add["inputs"] for l in layers[:position] if l is not add
               and l["name"] not in add["inputs"])


register_generator("keras-dag", FunctionalGenerator("keras-dag", _draw_dag, frozenset({"keras", "torch", "dag"})))
register_generator("keras-transformer", FunctionalGenerator(
    "keras-transformer", _draw_transformer, frozenset({"keras", "torch", "transformer", "blocks"})))
