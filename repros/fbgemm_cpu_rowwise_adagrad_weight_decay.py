"""fbgemm's CPU row-wise Adagrad ignores weight decay: L2 and decoupled alike.

    python repros/fbgemm_cpu_rowwise_adagrad_weight_decay.py

One table (6 rows × 4 columns) in fbgemm's SplitTableBatchedEmbeddingBagsCodegen on the CPU, trained one step by
EXACT_ROWWISE_ADAGRAD with weight_decay=0.5 under WeightDecayMode.L2 and DECOUPLE, against the same step without
weight decay and against the update fbgemm's own optimizer template documents for the rows the batch looks up
(L2: g' = g + wd·w, s = mean(g'²), w -= lr·g'/(√s + eps); decoupled: w = (1 - lr·wd)·w - lr·g/(√s + eps)).
The CPU backward's fast path for float tables (embedding_backward_split_cpu_template.cpp) calls fbgemm's
GenerateSparseAdaGrad kernel with `weight_decay=0`, so every mode trains as if weight_decay were 0.
Exit status 1 while a mode's weights equal the step without weight decay.
"""
import logging
import sys
import warnings

import torch

ROWS, DIM, LR, EPS, DECAY = 6, 4, 0.1, 1e-8, 0.5


def step(mode):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    options = {} if mode is None else {"weight_decay": DECAY, "weight_decay_mode": mode}
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR,
                                                eps=EPS, **options)
    tbe.split_embedding_weights()[0].copy_(initial())
    tbe(torch.tensor([0, 1, 2, 1]), torch.tensor([0, 2, 3, 4])).sum().backward()  # bags [0, 1], [2], [1]
    return tbe.split_embedding_weights()[0].detach().clone()


def initial():
    torch.manual_seed(0)
    return torch.randn(ROWS, DIM)


def documented(mode_name):
    """fbgemm's rule for the looked-up rows 0, 1, 2 (row 1 twice): the gradient of a sum is each row's count."""
    w = initial().double()
    counts = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)
    g = counts[:, None].expand(3, DIM).clone()
    if mode_name == "L2":
        g = g + DECAY * w[:3]
    s = (g * g).mean(dim=1, keepdim=True)
    multiplier = LR / (s.sqrt() + EPS)
    correction = 1 - LR * DECAY if mode_name == "DECOUPLE" else 1.0
    w[:3] = correction * w[:3] - multiplier * (g if mode_name == "L2" else counts[:, None])
    return w.float()


def main():
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import fbgemm_gpu
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    print(f"torch {torch.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}; row-wise Adagrad on the CPU, "
          f"weight_decay={DECAY}, lr={LR}")
    without = step(None)
    print(f"none     off the documented update by {(without - documented('NONE')).abs().max().item():.3g}")
    wrong = False
    for mode in (WeightDecayMode.L2, WeightDecayMode.DECOUPLE):
        weights = step(mode)
        unchanged = (weights - without).abs().max().item()
        off = (weights - documented(mode.name)).abs().max().item()
        print(f"{mode.name:8} change from weight decay {unchanged:.3g}; off the documented update by {off:.3g}")
        wrong |= unchanged == 0 and off > 1e-6
    print("BUG PRESENT" if wrong else "ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
