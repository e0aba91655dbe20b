"""Which device each rank computes on, and when a machine has too few: one rule for the worker groups and for the
processes a setting starts itself (a resume's phases).

NCCL runs one rank per GPU and refuses two ranks on one. gloo moves CUDA tensors through host memory, so with
`--backend gloo` several ranks may share a GPU (rank r on GPU r mod the GPUs there are): every multi-rank PyTorch
setting then runs its CUDA kernels on a one-GPU machine.
"""

from __future__ import annotations


def rank_device(device: str, backend: str, rank: int, gpus: int) -> str:
    """`cpu`, or `cuda:<i>` for rank `rank` given `gpus` visible GPUs (`device_refusal` said the world fits)."""
    if device == "cpu":
        return "cpu"
    return f"cuda:{rank % gpus if backend == 'gloo' and gpus else rank}"


def device_refusal(device: str, backend: str, world_size: int, gpus: int) -> str | None:
    """Why `world_size` ranks cannot run on this machine's devices, or None."""
    if device != "cuda":
        return None
    if gpus == 0:
        return "needs a CUDA device, this machine has none"
    if backend == "nccl" and gpus < world_size:
        return (f"needs {world_size} CUDA devices (NCCL runs one rank per GPU), this machine has {gpus}; "
                "--backend gloo lets ranks share a GPU")
    return None


# what gloo carries on CUDA tensors, per torch.distributed's backend table (docs: "Backends"): send/recv, reduce,
# all_gather, gather, scatter, reduce_scatter and all_to_all are CPU-only there. Used beyond it, gloo fails in ways
# that look like library bugs (writev "Bad address" on a device pointer, segfaults); they are not findings.
GLOO_ON_CUDA = frozenset({"all_reduce", "broadcast", "barrier"})


# the collectives of the usual strategies, for settings to declare theirs with (`Setting.collectives`)
DATA_PARALLEL = frozenset({"all_reduce", "broadcast"})
SHARDED = frozenset({"all_gather", "reduce_scatter"})
POINT_TO_POINT = frozenset({"send", "recv"})


def across(ranks: int, collectives: frozenset[str]) -> frozenset[str]:
    """`collectives` where `ranks` processes exchange tensors; none on one rank."""
    return collectives if ranks > 1 else frozenset()


def collective_refusal(device: str, backend: str, world_size: int, collectives: frozenset[str] | None) -> str | None:
    """Why a setting's collectives cannot run with `backend` on `device` tensors, or None. `collectives` None: the
    setting does not declare them, which passes where gloo carries everything (the CPU) and on one rank."""
    if not device.startswith("cuda") or backend != "gloo":
        return None
    hint = "run it with --device cuda --backend nccl, one GPU per rank"
    if collectives is None:
        return None if world_size < 2 else (
            "gloo carries only all_reduce and broadcast on CUDA tensors (torch.distributed's backend table) and this "
            f"setting does not declare which collectives it uses: {hint}")
    beyond = sorted(collectives - GLOO_ON_CUDA)
    if beyond:
        return (f"uses {', '.join(beyond)}, which gloo does not carry on CUDA tensors (torch.distributed's backend "
                f"table): {hint}")
    return None


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
