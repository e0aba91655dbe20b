"""A training program with everything a resume has to carry, run in phases (DETrain's checkpoint/resume).

The program: SGD with momentum 0.9 and a step learning-rate schedule (halved every 2 steps), fed by an
epoch loader that draws a fresh permutation of the model's training samples from torch's global RNG at the
start of every epoch and serves half of them per step — so after a resume the next batches depend on the
loader's position and permutation, the epoch after that on the RNG state, and the update on the momentum.
Each rank trains on its contiguous share of the loader's batch (data parallel); eval and parameters are
recorded like every other training setting (see `settings._training`), steps numbered across phases.

A phase runs steps (first_step, last_step], optionally after loading a checkpoint ("restore": everything
from `torch.distributed.checkpoint`; "fast-forward": model and optimizer from the checkpoint, the loader
replayed from the seed for `first_step` batches without training) and optionally saves one. The checkpoint
holds tensors and plain numbers only; it lives in a private temporary folder the case made and removes.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from difftest import (
    DATA_PARALLEL,
    SHARDED,
    Outputs,
    RunContext,
    Unsupported,
    across,
    device_refusal,
    gather_to_rank0,
    load_model,
    loss_record,
    rank_device,
    run_in_processes,
    to_numpy,
    visible_gpus,
)
from generators.inputs import Batch
from settings._training import build_for_training, canonical_parameters
from settings.fsdp import distribute

TOTAL_STEPS = 5
RENDEZVOUS_S = 30  # how long a phase's rank waits for its peers to join
MOMENTUM = 0.9
LR_HALVING_EVERY = 2
# what a full checkpoint carries; a planted fault leaves some out
CARRIED = frozenset({"model", "optimizer", "scheduler", "rng", "loader"})


@dataclass(frozen=True)
class Placement:
    """How the model is trained: one process, or DDP / FSDP2 (per-layer) over `world_size` ranks."""

    strategy: str  # "single" | "ddp" | "fsdp2"
    world_size: int = 1

    @property
    def label(self) -> str:
        return "single" if self.strategy == "single" else f"{self.strategy}-ws{self.world_size}"

    @property
    def collectives(self) -> frozenset[str]:
        return across(self.world_size, {"ddp": DATA_PARALLEL, "fsdp2": SHARDED}.get(self.strategy, frozenset()))


@dataclass(frozen=True)
class Phase:
    placement: Placement
    first_step: int  # steps already trained before this phase
    last_step: int
    load: str = ""  # "" | "restore" | "fast-forward"
    save: bool = False
    carried: frozenset[str] = CARRIED


class EpochLoader:
    """Serves `batch_size` sample positions a step from a per-epoch permutation of `samples` drawn from torch's global
    RNG (`take_samples` gives their data)."""

    def __init__(self, samples: int, batch_size: int) -> None:
        import torch

        self.samples, self.batch_size = samples, batch_size
        # an exhausted epoch 0, so the first batch draws a permutation and the state has one fixed shape
        self.order = torch.arange(samples)
        self.epoch, self.position = 0, samples

    def next(self) -> np.ndarray:
        import torch

        if self.position >= len(self.order):
            self.order, self.position, self.epoch = torch.randperm(self.samples), 0, self.epoch + 1
        picked = self.order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return picked.numpy()

    def state(self) -> dict[str, Any]:
        import torch

        return {"epoch": torch.tensor(self.epoch), "position": torch.tensor(self.position), "order": self.order.clone()}

    def load(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = state["order"].clone()


def take_samples(data: dict[str, Any], split: str, samples: np.ndarray) -> dict[str, Any]:
    """`data` with its batch `split` (`<split>.labels`, `.dense`, a sparse feature's `.sparse.<name>.lengths`, `.values`,
    `.weights`) holding the samples at positions `samples`, in that order: the batch a shuffling loader serves."""
    taken = {}
    for name, array in data.items():
        if name.startswith(f"{split}.sparse.") and name.endswith(".lengths"):
            offsets = np.concatenate([[0], np.cumsum(array)]).astype(np.int64)
            picked = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in samples] + [np.zeros(0, np.int64)])
            taken[name] = array[samples]
            for part in ("values", "weights"):
                if (bags := f"{name[:-len('lengths')]}{part}") in data:
                    taken[bags] = data[bags][picked]
        elif name.startswith(f"{split}.") and not name.startswith(f"{split}.sparse."):
            taken[name] = array[samples]
    return {**data, **taken}


def place(module: Any, strategy: str, group: Any, device: str, layout: dict[str, Any]) -> Any:
    """The model as a placement trains it: as it is in one process, in DistributedDataParallel, or in FSDP2 with a
    unit per layer (`distribute` of settings/fsdp.py, `layout` its units and options)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=group)
    return distribute(module, group, device, layout) if strategy == "fsdp2" else module


def sharded_layout(model: Any, module: Any) -> dict[str, Any]:
    """What `place` hands FSDP2's `distribute`: a unit per layer, as `fsdp2/per-layer/reshard/fp32` shards."""
    from settings.fsdp import FullyShard

    return FullyShard(1).layout(model, module)


def checkpoint_state(module: Any, optimizer: Any, scheduler: Any, loader: Any) -> dict[str, Any]:
    """What a checkpoint holds: the model's and optimizer's state dicts (torch.distributed.checkpoint's, whole or
    sharded as the placement holds them), the LR schedule, every RNG and the loader's position."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "rng": rng_state(), "loader": loader.state()}


def load_checkpoint(folder: str, module: Any, optimizer: Any, scheduler: Any, loader: Any, carried: Any,
                    group: Any) -> None:
    """The `carried` parts of the checkpoint in `folder`, resharded by torch.distributed.checkpoint to this placement."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = checkpoint_state(module, optimizer, scheduler, loader)  # the structure DCP fills in place
    state = {k: v for k, v in state.items() if k in carried}
    dcp.load(state, checkpoint_id=folder, process_group=group)
    if "model" in carried:
        set_model_state_dict(module, state["model"])
    if "optimizer" in carried:
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
    else:
        optimizer.state.clear()  # get_state_dict made empty momentum buffers; a fresh run has none
    if "scheduler" in carried:
        scheduler.load_state_dict(state["scheduler"])
    if "rng" in carried:
        set_rng_state(state["rng"])
    if "loader" in carried:
        loader.load(state["loader"])


def rng_state() -> dict[str, Any]:
    import torch

    _, keys, position, has_gauss, gauss = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_rest": torch.tensor([position, has_gauss], dtype=torch.int64), "numpy_gauss": torch.tensor(gauss, dtype=torch.float64),
        "python": torch.tensor(python_state, dtype=torch.int64), "python_rest": torch.tensor([version, -1 if gauss_next is None else 0]),
        "python_gauss": torch.tensor(0.0 if gauss_next is None else gauss_next, dtype=torch.float64),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    position, has_gauss = (int(v) for v in state["numpy_rest"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), position, has_gauss, float(state["numpy_gauss"])))
    version, gauss_flag = (int(v) for v in state["python_rest"])
    gauss_next = None if gauss_flag == -1 else float(state["python_gauss"])
    random.setstate((version, tuple(int(v) for v in state["python"]), gauss_next))


def seed_everything(seed: int) -> None:
    """What a worker does before every case (difftest/runner/worker.py), so fresh processes start alike."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class Trainer:
    """The program on this rank: the placed module, its optimizer, schedule and loader."""

    def __init__(self, ctx: RunContext, model: Any, inputs: Any, placement: Placement) -> None:
        import torch

        self.ctx, self.model, self.inputs, self.placement = ctx, model, inputs, placement
        module = build_for_training(model, ctx.device)
        self.module = place(module, placement.strategy, ctx.group, ctx.device,
                            sharded_layout(model, module) if placement.strategy == "fsdp2" else {})
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if not trainable:
            raise Unsupported("every parameter is frozen: nothing for a checkpoint's optimizer state to carry")
        self.optimizer = torch.optim.SGD(trainable, lr=ctx.lr, momentum=MOMENTUM)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, LR_HALVING_EVERY, gamma=0.5)
        self.train = inputs.train.to_arrays("train")
        self.loader = EpochLoader(inputs.train.size, inputs.train.size // 2)
        # the program seeds once its model is built (building draws initialisers), so the stream the loader
        # draws from is the same in every process whatever it built
        seed_everything(ctx.seed)

    def step(self) -> float:
        batch = Batch.from_arrays(take_samples(self.train, "train", self.loader.next()), "train")
        batch = batch.shard(self.ctx.rank, self.ctx.world_size)
        self.optimizer.zero_grad()
        loss = self.model.loss(self.model.forward(self.module, batch, self.ctx.device), batch)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def evaluate(self) -> dict[str, np.ndarray] | None:
        import torch

        with torch.no_grad():
            local = self.model.evaluate(self.module, self.inputs.eval.shard(self.ctx.rank, self.ctx.world_size), self.ctx.device)
        pieces = gather_to_rank0(self.ctx, {k: to_numpy(v) for k, v in local.items()})
        return None if pieces is None else {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(checkpoint_state(self.module, self.optimizer, self.scheduler, self.loader),
                 checkpoint_id=str(folder), process_group=self.ctx.group)

    def load(self, folder: Path, carried: frozenset[str]) -> None:
        load_checkpoint(str(folder), self.module, self.optimizer, self.scheduler, self.loader, carried, self.ctx.group)


def run_phase(ctx: RunContext, model: Any, inputs: Any, phase: Phase, checkpoint: Path | None) -> Outputs | None:
    """Run one phase on this rank; rank 0 returns what it recorded."""
    trainer = Trainer(ctx, model, inputs, phase.placement)
    outputs: Outputs = {}
    if phase.load == "restore":
        assert checkpoint is not None
        trainer.load(checkpoint, phase.carried)
    elif phase.load == "fast-forward":
        assert checkpoint is not None
        trainer.load(checkpoint, phase.carried & {"model", "optimizer", "scheduler"})
        for _ in range(phase.first_step):
            trainer.loader.next()  # DETrain's fast-forward: replay the loader, skip the step
    if phase.first_step == 0:
        outputs.update({f"eval_before/{k}": v for k, v in (trainer.evaluate() or {}).items()})
    for step in range(phase.first_step + 1, phase.last_step + 1):
        losses = gather_to_rank0(ctx, trainer.step())
        params = canonical_parameters(trainer.model, trainer.module)  # collective for DTensors
        if losses is not None:
            outputs[f"train_step{step}/loss"] = loss_record(losses)
            outputs.update({f"param_after_step{step}/{k}": v for k, v in params.items()})
    if phase.save:
        assert checkpoint is not None
        trainer.save(checkpoint)
    if phase.last_step == TOTAL_STEPS:
        outputs.update({f"eval_after_step{TOTAL_STEPS}/{k}": v for k, v in (trainer.evaluate() or {}).items()})
    return outputs if ctx.rank == 0 else None


def run_in_new_processes(ctx: RunContext, model_dir: Path, phase: Phase, checkpoint: Path, workdir: Path) -> Outputs:
    """Run `phase` in `phase.placement.world_size` fresh interpreters joined in a new process group (rendezvous
    through a file in `workdir`, no port at all); returns rank 0's outputs."""
    tag = f"{phase.first_step}-{phase.last_step}"
    request = {
        **new_group_request(ctx, model_dir, workdir, phase.placement.world_size, f"the {phase.placement.label} phase"),
        "checkpoint": str(checkpoint), "placement": dataclasses.asdict(phase.placement),
        "first_step": phase.first_step, "last_step": phase.last_step, "load": phase.load, "save": phase.save,
        "carried": sorted(phase.carried),
    }
    return run_in_processes(phase_main, request, phase.placement.world_size, workdir, tag, device=request["device"])


def new_group_request(ctx: RunContext, model_dir: Path, workdir: Path, processes: int, what: str) -> dict[str, Any]:
    """What `join_new_group` needs to start `processes` new processes of the case (`what` names them in a refusal):
    the sweep checked its own group's world size on a GPU, a group of new processes is checked here."""
    kind = ctx.device.split(":")[0]
    if kind == "cuda":
        why = device_refusal(kind, ctx.backend, processes, visible_gpus())
        if why:
            raise Unsupported(f"{what} {why}")
    return {"model_dir": str(model_dir), "workdir": str(workdir), "seed": ctx.seed, "lr": ctx.lr, "steps": ctx.steps,
            "device": kind, "backend": ctx.backend}


def join_new_group(request: Mapping[str, Any], rank: int, world_size: int, rendezvous: str) -> tuple[RunContext, Any,
                                                                                                   Any]:
    """A new process's part of its own group (`run_in_processes` starts it): join the group through the file
    `rendezvous` in the request's `workdir` (no port at all), load the case's model and inputs from `model_dir`; the
    case's run context over that group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = rank_device(request["device"], request["backend"], rank,
                         visible_gpus() if request["device"] == "cuda" else 0)
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    store = dist.FileStore(str(Path(request["workdir"]) / rendezvous), world_size)
    store.set_timeout(timedelta(seconds=RENDEZVOUS_S))  # a peer that never comes fails the phase in seconds
    dist.init_process_group(request["backend"], store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120),
                            device_id=torch.device(device) if request["backend"] == "nccl" else None)
    model, inputs = load_model(Path(request["model_dir"]))
    ctx = RunContext(rank=rank, world_size=world_size, local_world_size=world_size, device=device,
                     backend=request["backend"], group=dist.group.WORLD, steps=request["steps"], lr=request["lr"],
                     seed=request["seed"])
    return ctx, model, inputs


def phase_main(request: Mapping[str, Any], rank: int) -> Outputs | None:
    """One process of a phase (`run_in_processes` starts it): join the phase's own group, run the phase, return rank
    0's outputs."""
    import torch.distributed as dist

    placement = Placement(**request["placement"])
    phase = Phase(placement, request["first_step"], request["last_step"], request["load"], request["save"],
                  frozenset(request["carried"]))
    ctx, model, inputs = join_new_group(request, rank, placement.world_size, f"rendezvous-{phase.first_step}")
    outputs = run_phase(ctx, model, inputs, phase, Path(request["checkpoint"]))
    dist.barrier()
    return outputs


NOTES_FILE = "notes-rank0.json"


def train_in_new_processes(setting: Any, ctx: RunContext, model: Any, processes: int, what: str) -> Outputs | None:
    """`setting.train(ctx, model, inputs)` in `processes` new processes of their own group (`setting_main`), for a
    setting whose library keeps what it set up in process state that a second case in the same process would meet
    (torchtitan's meshes, DDP's compiled-autograd trace rules); `what` names them in a refusal and a failure.
    Rank 0's outputs come back."""
    import shutil
    import tempfile

    if model.model_dir is None:
        raise Unsupported("the model has no folder for new processes to load it from")
    workdir = Path(tempfile.mkdtemp(prefix="difftest-new-group-"))
    try:
        request = {**new_group_request(ctx, model.model_dir, workdir, processes, what), "processes": processes,
                   "setting": dataclasses.asdict(setting),
                   "setting_class": [type(setting).__module__, type(setting).__qualname__]}
        outputs = run_in_processes(setting_main, request, processes, workdir, "train", device=request["device"])
        if (notes := workdir / NOTES_FILE).is_file():  # what rank 0 noted of the case (graphs compiled, …)
            ctx.notes.update(json.loads(notes.read_text()))
        return outputs
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def setting_main(request: dict[str, Any], rank: int) -> Outputs | None:
    """One new process of `train_in_new_processes`: join the group, train, return rank 0's outputs."""
    import importlib

    import torch.distributed as dist

    module, name = request["setting_class"]  # the class the sweep ran (a plugin's, loaded in this process too)
    setting = getattr(importlib.import_module(module), name)(**request["setting"])
    ctx, model, inputs = join_new_group(request, rank, request["processes"], "rendezvous")
    outputs = setting.train(ctx, model, inputs)
    if rank == 0:
        (Path(request["workdir"]) / NOTES_FILE).write_text(json.dumps(ctx.notes))
    dist.barrier()
    return outputs
