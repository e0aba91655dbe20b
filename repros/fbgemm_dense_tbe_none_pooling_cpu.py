"""fbgemm's dense table-batched embedding on CPU pools (sums) although it was made with PoolingMode.NONE.

    python repros/fbgemm_dense_tbe_none_pooling_cpu.py

`DenseTableBatchedEmbeddingBagsCodegen(..., pooling_mode=PoolingMode.NONE, use_cpu=True)` is what TorchRec's
data-parallel EmbeddingCollection (sequence embeddings) runs on CPU (`BatchedDenseEmbedding`). With no pooling it must
return one row per index ([indices, dim]); on CPU it returns the per-bag sums ([batch, tables × dim]), equal to a
SUM-pooled module's output, so TorchRec then fails to split it by the features' lengths ("split_with_sizes expects
split_sizes to sum exactly to …"). Upstream: pytorch/FBGEMM#4586 (open; reported on 1.1.0).
Exit status 1 while the output is pooled.
"""
import sys

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen

tables = [(10, 8), (7, 8)]  # (rows, dim) of two tables
unpooled = DenseTableBatchedEmbeddingBagsCodegen(tables, pooling_mode=PoolingMode.NONE, use_cpu=True)
indices = torch.tensor([1, 2, 3, 4, 5])
offsets = torch.tensor([0, 2, 2, 4, 5])  # table 0: bags [1, 2], []; table 1: bags [3, 4], [5]
out = unpooled(indices, offsets)
weights = unpooled.split_embedding_weights()
expected = torch.cat([weights[0][indices[:2]], weights[1][indices[2:]]])  # one row per index

summed = DenseTableBatchedEmbeddingBagsCodegen(tables, pooling_mode=PoolingMode.SUM, use_cpu=True)
summed.load_state_dict(unpooled.state_dict())
print(f"torch {torch.__version__}; PoolingMode.NONE output {tuple(out.shape)}, expected {tuple(expected.shape)}; "
      f"equal to the SUM-pooled output: {out.shape == summed(indices, offsets).shape and torch.equal(out, summed(indices, offsets))}")
if out.shape != expected.shape or not torch.equal(out, expected):
    print("BUG PRESENT: the unpooled lookup came back pooled")
    sys.exit(1)
print("ok: one row per index")
