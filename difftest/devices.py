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


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
