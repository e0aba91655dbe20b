"""tf2onnx turns a constant a Keras functional model computes (`keras.ops.arange`) into a required graph input.

    python repros/tf2onnx_captured_constant_input.py

TensorFlow 2.21 (Keras 3), tf2onnx 1.17, opset 18. A model that adds learned position embeddings the usual way,
positions = zeros_like(tokens) + arange(length), exports without error, but the ONNX graph's Add reads
"functional_1/BiasAdd/bias:0", which is neither an initializer nor produced by a node: it is left as a graph input
the original model does not have. ONNX Runtime refuses to run it ("Required inputs ([...BiasAdd/bias:0]) are
missing from input feed"), onnx2pytorch fails ("is neither an activation nor an initializer of the graph").
The same positions computed as cumsum(ones_like(tokens)) - 1 export correctly and match Keras exactly.
Prints, for each form, the graph inputs and what ONNX Runtime says; exits 1 while the first form is broken.
"""

import sys

import numpy as np
import torch  # noqa: F401  (torch, then triton, before TF: the other order segfaults with CUDA torch builds)

try:
    import triton  # noqa: F401
except ImportError:
    pass
import keras
import onnxruntime
import tensorflow as tf
import tf2onnx

broken = False
for form in ("zeros_like + arange", "cumsum(ones_like) - 1"):
    tokens = keras.Input((4,), dtype="int32")
    if form.startswith("zeros_like"):
        positions = keras.ops.zeros_like(tokens) + keras.ops.arange(4, dtype="int32")
    else:
        positions = keras.ops.cumsum(keras.ops.ones_like(tokens), axis=1) - 1
    model = keras.Model(tokens, keras.layers.Embedding(4, 3)(positions))
    signature = (tf.TensorSpec((None, 4), tf.int32, name="x"),)
    proto, _ = tf2onnx.convert.from_function(tf.function(lambda x: model(x)), input_signature=signature, opset=18)
    inputs = [i.name for i in proto.graph.input]
    x = np.random.default_rng(0).integers(0, 4, (2, 4)).astype(np.int32)
    try:
        session = onnxruntime.InferenceSession(proto.SerializeToString())
        verdict = f"max |onnx - keras| = {np.abs(session.run(None, {'x': x})[0] - model(x).numpy()).max()}"
    except Exception as exc:
        verdict = f"{type(exc).__name__}: {str(exc)[:160]}"
        broken |= form.startswith("zeros_like")
    print(f"{form}: graph inputs {inputs}; onnxruntime: {verdict}")
sys.exit(1 if broken else 0)
