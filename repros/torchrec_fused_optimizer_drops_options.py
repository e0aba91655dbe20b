"""TorchRec's fused embedding optimizers accept torch.optim options their fbgemm kernels never apply.

    python repros/torchrec_fused_optimizer_drops_options.py

One table (6 rows × 4 columns) in TorchRec's FusedEmbeddingBagCollection, which maps a torch.optim class and its
options to an fbgemm kernel (`convert_optimizer_type_and_kwargs`, the mapping `apply_optimizer_in_backward` under
DistributedModelParallel uses too), trained two steps on one batch, against the same torch.optim class with the
same options on an EmbeddingBagCollection, compared on the rows the batch looks up (fbgemm updates only those).
SGD's momentum and weight_decay and Adagrad's weight_decay are handed to fbgemm, whose EXACT_SGD and EXACT_ADAGRAD
have neither: each trains exactly as if the option were not given, with no error and no warning (an option fbgemm's
constructor does not know, Adagrad's lr_decay, is refused with a TypeError).
Exit status 1 while an option changes the PyTorch optimizer's result and not the fused one's.
"""
import logging
import sys
import warnings

import torch

ROWS, DIM, LR, STEPS = 6, 4, 0.1, 2
LOOKED_UP = [0, 1, 2]


def collections():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f0"])]


def batch():
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([0, 1, 2, 1]),
                                               lengths=torch.tensor([2, 1, 1]))


def initial():
    torch.manual_seed(0)
    return torch.randn(ROWS, DIM)


def fused(optimizer, options):
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    tables = FusedEmbeddingBagCollection(tables=collections(), optimizer_type=optimizer, optimizer_kwargs=options)
    tables.state_dict()["embedding_bags.t0.weight"].copy_(initial())
    for _ in range(STEPS):
        tables(batch()).values().sum().backward()  # the optimizer steps inside backward
    return tables.state_dict()["embedding_bags.t0.weight"][LOOKED_UP].clone()


def pytorch(optimizer, options):
    from torchrec import EmbeddingBagCollection

    tables = EmbeddingBagCollection(tables=collections())
    tables.embedding_bags["t0"].weight.data.copy_(initial())
    step = optimizer(tables.parameters(), **options)
    for _ in range(STEPS):
        step.zero_grad()
        tables(batch()).values().sum().backward()
        step.step()
    return tables.embedding_bags["t0"].weight.detach()[LOOKED_UP].clone()


def main():
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torchrec
    print(f"torch {torch.__version__}, torchrec {torchrec.__version__}; {STEPS} steps, lr={LR}, the looked-up rows")
    wrong = False
    for optimizer, option in [(torch.optim.SGD, {"momentum": 0.9}), (torch.optim.SGD, {"weight_decay": 0.5}),
                              (torch.optim.Adagrad, {"weight_decay": 0.5})]:
        base = {"lr": LR, "eps": 1e-8} if optimizer is not torch.optim.SGD else {"lr": LR}
        without, given = fused(optimizer, base), fused(optimizer, {**base, **option})
        expected = pytorch(optimizer, {**base, **option})
        ignored = (given - without).abs().max().item()
        off = (given - expected).abs().max().item()
        print(f"{optimizer.__name__:8} {option}: fused change from the option {ignored:.3g}; "
              f"off {optimizer.__name__} by {off:.3g}")
        wrong |= ignored == 0 and off > 1e-6
    print("BUG PRESENT" if wrong else "ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
