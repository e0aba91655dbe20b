"""Muffin-style random Keras Sequential models, materialised in TensorFlow and (via ONNX) in PyTorch.

A spec is a list of layers drawn from a catalogue by a numpy generator seeded by (seed, index); a small
shape inference keeps every draw valid. Odd indices are the variant with one layer frozen.

Training semantics: both frameworks train the *inference form* of the graph (`training=False`): Dropout is
the identity and BatchNormalization uses its moving statistics with trainable gamma/beta. The ONNX graph
can only carry that form (tf2onnx removes Dropout and folds BatchNorm), so it is the one all sides share.

Weights are named by their Keras path without the model prefix (`l2_conv2d/kernel`) and kept in Keras
layout; the PyTorch side maps its parameters back to those names and layouts (see `generators.conversion`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Any

import numpy as np

from difftest import UNPLACED, Generator, ModelSpec, register_generator
from generators import _tf
from generators.inputs import Batch
from generators.onnx_files import EXPORT_ERROR_FILE, ONNX_FILE

KIND = "sequential"
DEFAULT_CONVERTER = "onnx2pytorch"
OPSET = 18  # tf2onnx 1.17's maximum

ACTIVATIONS = ("relu", "tanh", "sigmoid", "softmax", "gelu", "elu", "selu", "swish", "leaky_relu")


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([0x5E0, *key]))


def _pick(rng: np.random.Generator, options: list[Any] | tuple[Any, ...]) -> Any:
    return options[int(rng.integers(len(options)))]


# --- the layer catalogue: per input form, the layers that accept it and the shape they produce ---------------
# A shape is the per-sample shape: (F,) flat, (T, F) sequence, (H, W, C) image.

def _dense(rng, shape):
    return {"class": "Dense", "units": int(rng.integers(2, 17)), "activation": _pick(rng, (None,) + ACTIVATIONS)}, shape[:-1] + (None,)


def _norm(rng, shape):
    if rng.random() < 0.5:
        return {"class": "BatchNormalization"}, shape
    return {"class": "LayerNormalization"}, shape


def _dropout(rng, shape):
    return {"class": "Dropout", "rate": round(float(rng.uniform(0.1, 0.5)), 2)}, shape


def _activation(rng, shape):
    return {"class": "Activation", "activation": _pick(rng, ACTIVATIONS)}, shape


def _flatten(rng, shape):
    return {"class": "Flatten"}, (math.prod(shape),)


def _conv1d(rng, shape):
    t, _ = shape
    k = int(rng.integers(1, min(3, t) + 1))
    padding = _pick(rng, ("valid", "same"))
    strides = int(rng.integers(1, 3)) if padding == "valid" else 1
    filters = int(rng.integers(2, 9))
    out_t = (t - k) // strides + 1 if padding == "valid" else t
    return {"class": "Conv1D", "filters": filters, "kernel_size": k, "strides": strides, "padding": padding,
            "activation": _pick(rng, (None,) + ACTIVATIONS)}, (out_t, filters)


def _pool1d(rng, shape):
    t, f = shape
    pool = int(rng.integers(2, min(3, t) + 1))
    return {"class": _pick(rng, ("MaxPooling1D", "AveragePooling1D")), "pool_size": pool}, (t // pool, f)


def _gap1d(rng, shape):
    return {"class": "GlobalAveragePooling1D"}, (shape[-1],)


def _rnn(rng, shape):
    units = int(rng.integers(2, 9))
    sequences = bool(rng.random() < 0.5)
    layer = {"class": _pick(rng, ("LSTM", "GRU", "SimpleRNN")), "units": units, "return_sequences": sequences}
    return layer, (shape[0], units) if sequences else (units,)


def _pad1d(rng, shape):
    p = int(rng.integers(1, 3))
    return {"class": "ZeroPadding1D", "padding": p}, (shape[0] + 2 * p, shape[1])


def _crop1d(rng, shape):
    return {"class": "Cropping1D", "cropping": 1}, (shape[0] - 2, shape[1])


def _conv2d(rng, shape):
    h, w, _ = shape
    k = int(rng.integers(1, min(3, h, w) + 1))
    padding = _pick(rng, ("valid", "same"))
    strides = int(rng.integers(1, 3)) if padding == "valid" else 1
    kind = _pick(rng, ("Conv2D", "DepthwiseConv2D", "SeparableConv2D"))
    out = lambda n: (n - k) // strides + 1 if padding == "valid" else n
    layer = {"class": kind, "kernel_size": k, "strides": strides, "padding": padding,
             "activation": _pick(rng, (None,) + ACTIVATIONS)}
    channels = shape[2]
    if kind == "DepthwiseConv2D":
        layer["depth_multiplier"] = int(rng.integers(1, 3))
        channels *= layer["depth_multiplier"]
    else:
        layer["filters"] = channels = int(rng.integers(2, 9))
    return layer, (out(h), out(w), channels)


def _pool2d(rng, shape):
    h, w, c = shape
    return {"class": _pick(rng, ("MaxPooling2D", "AveragePooling2D")), "pool_size": 2}, (h // 2, w // 2, c)


def _gap2d(rng, shape):
    return {"class": "GlobalAveragePooling2D"}, (shape[-1],)


def _pad2d(rng, shape):
    return {"class": "ZeroPadding2D", "padding": 1}, (shape[0] + 2, shape[1] + 2, shape[2])


def _crop2d(rng, shape):
    return {"class": "Cropping2D", "cropping": 1}, (shape[0] - 2, shape[1] - 2, shape[2])


def _image_to_sequence(rng, shape):
    h, w, c = shape
    return {"class": "Reshape", "target_shape": [h * w, c]}, (h * w, c)


def _flat_to_sequence(rng, shape):
    (f,) = shape
    return {"class": "Reshape", "target_shape": [2, f // 2]}, (2, f // 2)


def _candidates(shape: tuple) -> list:
    common = [_dense, _norm, _dropout, _activation]
    if len(shape) == 1:
        return common + ([_flat_to_sequence] if shape[0] % 2 == 0 and shape[0] >= 4 else [])
    if len(shape) == 2:
        t = shape[0]
        return common + [_flatten, _gap1d, _rnn, _pad1d, _conv1d] + ([_pool1d] if t >= 2 else []) + ([_crop1d] if t > 3 else [])
    h, w, _ = shape
    return (common + [_flatten, _gap2d, _pad2d, _conv2d, _image_to_sequence]
            + ([_pool2d] if min(h, w) >= 2 else []) + ([_crop2d] if min(h, w) > 3 else []))


def _draw_layers(rng: np.random.Generator) -> tuple[dict, list[dict], int]:
    form = _pick(rng, ("image", "sequence", "tokens"))
    if form == "image":
        side = int(rng.integers(6, 11))
        shape: tuple = (side, side, int(rng.integers(1, 4)))
        source = {"form": form, "shape": list(shape)}
        layers: list[dict] = []
    elif form == "sequence":
        shape = (int(rng.integers(4, 9)), int(rng.integers(2, 7)))
        source = {"form": form, "shape": list(shape)}
        layers = []
    else:
        length, vocab = int(rng.integers(4, 9)), int(rng.integers(8, 33))
        source = {"form": form, "shape": [length], "vocab": vocab}
        dim = int(rng.integers(2, 7))
        layers = [{"class": "Embedding", "input_dim": vocab, "output_dim": dim}]
        shape = (length, dim)
    for _ in range(int(rng.integers(2, 7))):
        layer, shape = _pick(rng, _candidates(shape))(rng, shape)
        if layer["class"] == "Dense":
            shape = shape[:-1] + (layer["units"],)
        if math.prod(shape) > 4096 or min(shape) < 1:
            break  # keep cases small; the previous shape stays valid because `layers` is unchanged
        layers.append(layer)
    if len(shape) > 1:
        layers.append({"class": "Flatten"})
    classes = int(rng.integers(2, 6))
    layers.append({"class": "Dense", "units": classes, "activation": None})  # logits; the loss applies softmax
    for i, layer in enumerate(layers):
        layer["name"] = f"l{i}_{layer['class'].lower()}"
    return source, layers, classes


class SequentialGenerator(Generator):
    kind = KIND
    traits = frozenset({"keras", "torch"})
    builds_copied = True  # a build converts the ONNX graph and maps the Keras weights: 5-50 ms, a deep copy 1-14

    def available(self) -> str | None:
        return _tf.missing()

    def spec(self, seed: int, index: int) -> ModelSpec:
        rng = _rng(seed, index)
        source, layers, classes = _draw_layers(rng)
        for layer in layers:  # exact gelu exports as Erfc, the tanh form does not: draw both
            if layer.get("activation") == "gelu" or (layer["class"] == "Activation" and layer["activation"] == "gelu"):
                layer["gelu_approximate"] = bool(rng.random() < 0.5)
        frozen: tuple[str, ...] = ()
        if index % 2 == 1:  # freeze one layer, never the last: a model with nothing to train tests nothing
            weighted = [l["name"] for l in layers[:-1] if l["class"] not in _WEIGHTLESS]
            if not weighted:
                layers.insert(-1, {"class": "Dense", "units": int(rng.integers(2, 17)), "activation": None,
                                   "name": f"l{len(layers) - 1}_dense_frozen"})
                weighted = [layers[-2]["name"]]
            frozen = (_pick(rng, weighted),)
        params = {"input": source, "layers": layers, "classes": classes, "converter": DEFAULT_CONVERTER}
        return ModelSpec(kind=KIND, seed=seed, index=index, params=params, frozen=frozen, input_seed=0)

    # --- TensorFlow side ----------------------------------------------------------------------------------
    def keras_model(self, spec: ModelSpec, state: dict[str, np.ndarray] | None = None, dtype: str = "float32") -> Any:
        """The Keras model; `dtype` "float64" builds every layer and the input in float64 (a calibration run)."""
        _, keras = _tf.import_tensorflow()
        source = spec.params["input"]
        # layers take their dtype from the global dtype policy, which Keras fixes from floatx the first time it is
        # read: both are set for a float64 build and put back, and a float32 build leaves them as they are (a
        # mixed-precision setting has set its own policy)
        before = (keras.config.floatx(), keras.config.dtype_policy())
        if dtype != "float32":
            keras.config.set_floatx(dtype)
            keras.config.set_dtype_policy(dtype)
        try:
            model = self.assemble(keras, spec, keras.Input(tuple(source["shape"]),
                                                           dtype="int32" if source["form"] == "tokens" else dtype))
        finally:
            if dtype != "float32":
                keras.config.set_floatx(before[0])
                keras.config.set_dtype_policy(before[1])
        for layer in model.layers:
            if layer.name in spec.frozen:
                layer.trainable = False
        if state is not None:
            for weight in model.weights:
                weight.assign(state[weight_name(weight)])
        return model

    def assemble(self, keras: Any, spec: ModelSpec, model_input: Any) -> Any:
        """The Keras model of `spec`'s layers on `model_input`, named "seq" (weights are named by their path below it)."""
        model = keras.Sequential([model_input], name="seq")
        for layer in spec.params["layers"]:
            model.add(_keras_layer(keras, layer))
        return model

    def layer_by_layer(self, keras: Any, spec: ModelSpec, model: Any, x: Any, visit: Any) -> Any:
        """`model`'s output on `x` (inference form), layer by layer: `visit(layer, value)` sees, and may replace, each
        value a layer reads (a quantization bound differentiates the output by them)."""
        hidden = x
        for layer in model.layers:
            hidden = layer(visit(layer, hidden), training=False)
        return hidden

    def init_state(self, spec: ModelSpec) -> dict[str, np.ndarray]:
        rng = _rng(spec.seed, spec.index, 1)
        state = {}
        for weight in self.keras_model(spec).weights:
            name, shape = weight_name(weight), tuple(weight.shape)
            leaf = name.rsplit("/", 1)[-1]
            if leaf in ("gamma", "moving_variance"):
                value = rng.uniform(0.5, 1.5, size=shape)
            elif leaf in ("beta", "moving_mean", "bias", "embeddings"):
                value = rng.uniform(-0.2, 0.2, size=shape)  # never all zero: tf2onnx would drop the bias
            else:
                fan_in = math.prod(shape[:-1]) or 1
                value = rng.uniform(-1.0, 1.0, size=shape) * math.sqrt(3.0 / fan_in)
            state[name] = value.astype(np.float32)
        return state

    def inputs(self, spec: ModelSpec, batch_size: int) -> dict[str, Batch]:
        rng = _rng(spec.seed, spec.index, 2, spec.input_seed)
        source = spec.params["input"]
        classes = spec.params["classes"]
        batches = {}
        for split in ("train", "eval"):
            if source["form"] == "tokens":
                x = rng.integers(0, source["vocab"], size=(batch_size, *source["shape"])).astype(np.int32)
            else:
                x = rng.normal(size=(batch_size, *source["shape"])).astype(np.float32)
            labels = np.eye(classes, dtype=np.float32)[rng.integers(0, classes, size=batch_size)]
            batches[split] = Batch(labels=labels, dense=x)
        return batches

    def artifacts(self, spec: ModelSpec, state: dict[str, np.ndarray]) -> dict[str, bytes]:
        """The ONNX export (or tf2onnx's error), written next to the spec at generation time."""
        try:
            return {ONNX_FILE: export_onnx(self.keras_model(spec, state), spec)}
        except Exception as exc:  # a failed export is a finding, reported by the conversion settings
            return {EXPORT_ERROR_FILE: f"tf2onnx {type(exc).__name__}: {exc}".encode()}

    # --- minimisation: smaller models of the same structure, most removed first -----------------------------
    def size(self, spec: ModelSpec) -> dict[str, int]:
        layers = spec.params["layers"]
        widths = [l.get("units") or l.get("filters") or 0 for l in layers]
        return {"layers": len(layers), "input": math.prod(spec.params["input"]["shape"]), "width": sum(widths)}

    def reductions(self, spec: ModelSpec) -> list[tuple[str, dict[str, Any]]]:
        """(what it removes, params) for each one-step-smaller model: a layer dropped (never the logits), a layer
        narrowed, the input shrunk. Some break the shapes of later layers; Keras refuses those, and the minimiser
        drops a candidate it cannot build."""
        p = spec.params
        layers = p["layers"]
        first = 1 if p["input"]["form"] == "tokens" else 0  # the Embedding turns token ids into floats
        out: list[tuple[str, dict[str, Any]]] = []
        for i in range(first, len(layers) - 1):
            out.append((f"drop layer {layers[i]['name']}", {**p, "layers": layers[:i] + layers[i + 1:]}))
        for i, layer in enumerate(layers[:-1]):
            for key in ("units", "filters"):
                if layer.get(key, 0) > 2:
                    narrowed = {**layer, key: 2}
                    out.append((f"layer {layer['name']} 2 wide", {**p, "layers": layers[:i] + [narrowed] + layers[i + 1:]}))
        shape = p["input"]["shape"]
        if p["input"]["form"] != "tokens" and shape[0] > 2:
            smaller = [max(2, shape[0] // 2)] + (shape[1:2] if p["input"]["form"] == "sequence" else [max(2, shape[1] // 2)]) + shape[2:]
            out.append(("input halved", {**p, "input": {**p["input"], "shape": smaller}}))
        return out

    # --- PyTorch side (workers only) ----------------------------------------------------------------------
    def build(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None,
              converter: str | None = None) -> Any:
        from generators.conversion import convert_onnx

        return convert_onnx(self, spec, init_state, model_dir, converter or spec.params["converter"], device)

    def chain(self, spec: ModelSpec, init_state: dict[str, np.ndarray], device: str, model_dir: Any = None,
              converter: str | None = None) -> Any:
        from generators.conversion import convert_chain

        return convert_chain(self, spec, init_state, model_dir, converter or spec.params["converter"], device)

    def forward(self, module: Any, batch: Batch, device: str) -> Any:
        import torch

        return module(torch.from_numpy(batch.dense).to(device))

    def evaluate(self, module: Any, batch: Batch, device: str) -> dict[str, Any]:
        """The logits, and each layer's output (`l3_dense/act`) where the converted module exposes it, so a finding
        names the layer it starts in (compared only where both sides recorded it: `difftest.judging.oracle.ACTIVATION`)."""
        from torch.distributed.tensor import DTensor

        inner = _converted(module)
        if inner is None:
            return {"logits": self.forward(module, batch, device)}
        inner.captured = {}
        try:
            logits = self.forward(module, batch, device)
            layers = {f"{name}/act": v.full_tensor() if isinstance(v, DTensor) else v  # tensor parallel
                      for name, v in inner.captured.items()}
        finally:
            inner.captured = None
        return {"logits": logits, **layers}

    def loss(self, prediction: Any, batch: Batch) -> Any:
        import torch

        return logits_loss(prediction, torch.from_numpy(batch.labels).to(prediction.device))

    def features(self, spec: ModelSpec) -> list[str]:
        """What `analyze` tabulates findings by: the model's layer kinds and activations."""
        return _features(spec)

    def frozen_names(self, params: dict[str, Any]) -> set[str]:
        return {layer["name"] for layer in params["layers"]}

    def tensor_order(self, tensor: str) -> tuple[int, int]:
        layer = re.match(r"l(\d+)_", tensor)  # a Keras layer is named l<position>_<kind>: its position orders it
        if layer:
            return (1, int(layer.group(1)))
        return (4, 0) if tensor == "prediction" else (5, 0) if tensor == "loss" else (UNPLACED, 0)

    def tensor_class(self, tensor: str) -> str:
        return super().tensor_class(re.sub(r"^l\d+_", "", tensor))  # `l2_dense/kernel` → `dense/kernel`

    def parameters(self, module: Any) -> dict[str, Any]:
        return model_parameters(module)

    def standalone_model(self, spec: ModelSpec, init_state: dict[str, np.ndarray], model_dir: Any,
                         train: Batch) -> Any:
        from generators.conversion import converted_model_code

        probe = self.inputs(spec, 12)["eval"].dense
        return converted_model_code(spec, init_state, model_dir, probe, (logits_loss, model_loss, _unwrap,
                                                                         model_parameters),
                                    train.to_arrays("train"))


_WEIGHTLESS = {"Dropout", "Activation", "Flatten", "Reshape", "MaxPooling1D", "AveragePooling1D", "MaxPooling2D",
               "AveragePooling2D", "GlobalAveragePooling1D", "GlobalAveragePooling2D", "ZeroPadding1D",
               "ZeroPadding2D", "Cropping1D", "Cropping2D"}


def weight_name(weight: Any) -> str:
    # a Sequential model puts its own name first ("seq/l0_dense/kernel"), a functional one does not
    return weight.path.split("/", 1)[1] if weight.path.startswith("seq/") else weight.path


def _features(spec: ModelSpec) -> list[str]:
    """The distinct layer kinds of a model, activations included (`Dense`, `act:gelu`)."""
    kinds = []
    for layer in spec.params["layers"]:
        kinds.append(layer["class"])
        if layer.get("activation"):
            kinds.append(f"act:{layer['activation']}" + ("~tanh" if layer.get("gelu_approximate") else ""))
    return sorted(set(kinds))


def _keras_layer(keras: Any, layer: dict) -> Any:
    config = {k: v for k, v in layer.items() if k not in ("class", "gelu_approximate", "inputs", "call", "use_causal_mask")}
    activation = config.get("activation")
    if activation == "gelu":
        approximate = layer.get("gelu_approximate", False)
        config["activation"] = lambda x: keras.activations.gelu(x, approximate=approximate)
    elif activation == "leaky_relu":
        config["activation"] = keras.activations.leaky_relu
    return getattr(keras.layers, layer["class"])(**config)


def export_onnx(model: Any, spec: ModelSpec) -> bytes:
    tf, _ = _tf.import_tensorflow()
    import tf2onnx

    source = spec.params["input"]
    dtype = tf.int32 if source["form"] == "tokens" else tf.float32
    signature = (tf.TensorSpec((None, *source["shape"]), dtype, name="x"),)
    function = tf.function(lambda x: model(x, training=False))
    # tf2onnx logs at ERROR what it cannot map (exact gelu's Erfc) and exports it anyway: what that costs is
    # measured by the conversion settings, so its log would only print through the progress display
    # (its loggers are made and levelled inside the conversion, so only a global threshold holds them)
    logging.disable(logging.ERROR)
    try:
        proto = _converted_without_copies(tf2onnx, function, signature)
    finally:
        logging.disable(logging.NOTSET)
    return proto.SerializeToString()


def _converted_without_copies(tf2onnx: Any, function: Any, signature: Any) -> Any:
    """tf2onnx's export, its graph optimizers run in place: by default it deep-copies the graph before each of them so
    that one that raises can be skipped, which is half of a transformer's export (1.0 s against 0.5 s). In place, the
    same graph comes out (the same nodes and weights, in another topological order); where an optimizer raises, the
    export is redone tf2onnx's default way, which skips it."""
    switch = tf2onnx.constants.ENV_TF2ONNX_CATCH_ERRORS  # read by each conversion
    os.environ[switch] = "FALSE"
    try:
        return tf2onnx.convert.from_function(function, input_signature=signature, opset=OPSET)[0]
    except Exception:  # an optimizer raised (or the export fails): once more, as tf2onnx does it by default
        del os.environ[switch]
        return tf2onnx.convert.from_function(function, input_signature=signature, opset=OPSET)[0]
    finally:
        os.environ.pop(switch, None)


def _converted(module: Any) -> Any:
    """The ConvertedModel inside DDP/FSDP wrappers (by its own attributes: legacy FSDP forwards lookups inward)."""
    while "keras_shapes" not in vars(module):
        module = getattr(module, "module", None) or getattr(module, "_fsdp_wrapped_module", None)
        if module is None:
            return None
    return module


def logits_loss(prediction: Any, labels: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(prediction, labels)


def model_loss(module: Any, data: dict[str, Any], start: int, stop: int, dtype: Any) -> Any:
    """The loss on training samples start..stop of a standalone script's data, as `forward` and `loss` compute it."""
    import torch

    dense = torch.from_numpy(data["train.dense"][start:stop]).to(dtype)
    return logits_loss(module(dense), torch.from_numpy(data["train.labels"][start:stop]))


def model_parameters(module: Any) -> dict[str, Any]:
    """Keras name → tensor in Keras layout (views of the trainable PyTorch parameters), through any wrapper."""
    return _unwrap(module).keras_parameters()


def _unwrap(module: Any) -> Any:
    while not hasattr(module, "keras_parameters"):
        module = module.module
    return module


register_generator(KIND, SequentialGenerator())
