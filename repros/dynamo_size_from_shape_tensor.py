"""torch.compile raises an internal Dynamo error on `torch.Size(shape)` when `shape` is a 1-D integer tensor.

    python repros/dynamo_size_from_shape_tensor.py

ONNX converters keep a target shape as an int64 tensor: onnx2pytorch's ConstantOfShape runs
`constant.expand(torch.Size(shape))`, onnx2torch's Reshape the same construction. Eager PyTorch takes it (each
0-d tensor is an index); under torch.compile, Dynamo builds the Size from FakeTensor items and fails with
"InternalTorchDynamoError: TypeError: torch.Size() takes an iterable of 'int' (item 0 is 'FakeTensor')" instead of
tracing it or breaking the graph (torch 2.12.1 and 2.14.1, CPU). Every Keras model difftest converts through
onnx2pytorch fails so under compiled training. Exit 1 while it raises, 0 once the compiled call matches eager.
"""

import sys

import torch


def constant_of_shape(shape: torch.Tensor) -> torch.Tensor:
    return torch.tensor(0.5).expand(torch.Size(shape))


shape = torch.tensor([2, 3])
eager = constant_of_shape(shape)
print(f"torch {torch.__version__}: eager shape {tuple(eager.shape)}")
try:
    compiled = torch.compile(constant_of_shape)(shape)
except Exception as exc:  # the bug: Dynamo's own TypeError, not a graph break
    print(f"compiled: {type(exc).__name__}: {str(exc).splitlines()[0]}\nBUG PRESENT")
    sys.exit(1)
print(f"compiled shape {tuple(compiled.shape)}: {'ok' if torch.equal(compiled, eager) else 'BUG PRESENT (values differ)'}")
sys.exit(0 if torch.equal(compiled, eager) else 1)
