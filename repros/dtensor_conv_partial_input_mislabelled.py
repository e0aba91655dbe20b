"""DTensor convolves a Partial(sum) input without the reduce-scatter its own sharding propagation chose.

    python repros/dtensor_conv_partial_input_mislabelled.py

A 1x1 convolution (stride equal to the kernel's width, so DTensor's width-sharding strategy applies) on an input
that is Partial(sum), as a row-wise Linear leaves its output. The sharding propagator has no strategy for a Partial
input, so it asks for the input to be reduce-scattered to Shard(3) and labels the output Shard(3).
`convolution_handler` (torch/distributed/tensor/_tp_conv.py) runs the local convolution on the input as it is,
without that redistribution: each rank's local output is its whole-width partial sum, labelled as its share of the
width. Found by a campaign on a converted Keras model under dtensor/last-sharded/ws2, where a later reshape failed
on the mislabelled tensor. Exit 1 while the output's placement and local tensor disagree or its value is wrong; 2
where the convolution refuses the input (torch 2.6.0: "Sharding propagation failed").
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def rank_main(rank: int, folder: str) -> None:
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    mesh = DeviceMesh("cpu", list(range(WORLD_SIZE)))
    torch.manual_seed(0)
    summands = torch.randn(WORLD_SIZE, 4, 6, 1, 8)  # the input is the sum of one summand per rank
    weight = torch.randn(3, 6, 1, 1)
    x = DTensor.from_local(summands[rank], mesh, [Partial()])
    try:
        out = torch.nn.functional.conv2d(x, DTensor.from_local(weight, mesh, [Replicate()]))
    except RuntimeError as exc:  # torch 2.6: the propagation refuses a Partial input, loudly: not this bug
        if rank == 0:
            print(f"torch {torch.__version__}: the convolution refuses: {str(exc).splitlines()[0]}")
            with open(os.path.join(folder, "verdict"), "w") as verdict:
                verdict.write("2")
        return
    expected = torch.nn.functional.conv2d(summands.sum(0), weight)
    # a Shard(3) label promises each rank 1 / WORLD_SIZE of the width
    mislabelled = out.placements[0].is_shard(3) and out.to_local().shape[3] * WORLD_SIZE != out.shape[3]
    try:
        whole = out.full_tensor()
        result = f"full_tensor() {float((whole - expected).abs().max()):.3g} off the convolution of the summed input"
        wrong = mislabelled or not torch.allclose(whole, expected, atol=1e-5)
    except RuntimeError as exc:  # the mislabelled tensor cannot be gathered
        result, wrong = f"full_tensor() raises: {str(exc).splitlines()[0]}", True
    if rank == 0:
        print(f"torch {torch.__version__}: output {tuple(out.shape)} {out.placements}, "
              f"rank 0 holds {tuple(out.to_local().shape)}; {result}")
        print("BUG PRESENT" if wrong else "ok")
        with open(os.path.join(folder, "verdict"), "w") as verdict:
            verdict.write("1" if wrong else "0")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(rank_main, args=(folder,), nprocs=WORLD_SIZE, start_method="fork")
        sys.exit(int(open(os.path.join(folder, "verdict")).read()))
