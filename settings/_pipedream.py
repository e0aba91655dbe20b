"""PipeDream's schedule as the async-pipeline setting runs it: the 1F1B order of a stage's forward and backward
passes, which weight version each forward uses (`forward_version`: flushed or stale), and a stage that stashes the
weights each micro-batch's forward saw so its backward uses them."""

from __future__ import annotations

from collections import deque
from typing import Any


def forward_version(mode: str, step_start: int, micro: int, stage: int, stages: int) -> int:
    """The weight version micro-batch `micro` of a step sees on `stage`, counted in updates since the start."""
    if mode == "flush":
        return step_start
    lag = stages - 1 - stage if mode == "stash" else stages - 1
    return step_start + max(0, micro - lag)


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _run(module: Any, weights: dict[str, Any], inputs: tuple) -> tuple:
    from torch.func import functional_call

    return _as_tuple(functional_call(module, weights, inputs))


class _StashedStage:
    """One stage's live weights, version counter, stash queue and saved inputs."""

    def __init__(self, module: Any, lr: float, mode: str, capacity: int) -> None:
        self.module, self.lr, self.mode = module, lr, mode
        self.live = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.version = 0
        self.history: dict[int, dict[str, Any]] = {0: self.snapshot()}  # vertical sync reads older versions
        self.stash: deque = deque(maxlen=capacity)
        self.saved: dict[int, tuple] = {}
        self.accumulated: dict[str, Any] = {}
        self.violations: list[str] = []
        self.forward_versions: dict[int, int] = {}  # the version each in-flight micro-batch's forward used

    def snapshot(self) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in self.live.items()}

    def forward(self, micro: int, version: int, inputs: tuple) -> tuple:
        import torch

        weights = self.history[version] if self.mode == "vertical-sync" else self.snapshot()
        if self.mode != "vertical-sync" and version != self.version:
            self.violations.append(f"micro-batch {micro}: live version {self.version}, expected {version}")
        self.stash.append((micro, version, weights))
        self.saved[micro] = inputs
        with torch.no_grad():
            return _run(self.module, weights, inputs)

    def backward(self, micro: int, loss_of: Any, output_grads: tuple | None, scale: float) -> tuple[tuple, Any]:
        """Gradients for the inputs that require them, and the loss on the last stage (else None)."""
        import torch

        entries = [e for e in self.stash if e[0] == micro]
        if entries:
            self.stash.remove(entries[0])
            _, version, weights = entries[0]
        else:  # evicted: what an implementation without the right stash would do, use the live weights
            version, weights = self.version, self.snapshot()
            self.violations.append(f"micro-batch {micro}: no stashed weights, backward on live version {version}")
        forward_seen = self.forward_versions.get(micro)
        if forward_seen is not None and forward_seen != version:
            self.violations.append(f"micro-batch {micro}: forward on version {forward_seen}, backward on {version}")
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in self.saved.pop(micro))
        leaves = {n: w.detach().requires_grad_(True) for n, w in weights.items()}
        outputs = _run(self.module, leaves, inputs)
        loss = None
        if output_grads is None:
            loss = loss_of(outputs[0])
            (loss * scale).backward()
        else:
            pairs = [(o, g) for o, g in zip(outputs, output_grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.apply({n: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)) for n, leaf in leaves.items()})
        grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.requires_grad)
        return grads, None if loss is None else loss.detach()

    def apply(self, grads: dict[str, Any]) -> None:
        import torch

        if self.mode == "flush":
            for n, g in grads.items():
                self.accumulated[n] = g.clone() if n not in self.accumulated else self.accumulated[n].add_(g)
            return
        with torch.no_grad():
            for n, g in grads.items():
                self.live[n].add_(g, alpha=-self.lr)
        self.version += 1
        if self.mode == "vertical-sync":
            self.history[self.version] = self.snapshot()

    def end_step(self, oldest_needed: int) -> None:
        import torch

        if self.mode == "flush":
            with torch.no_grad():
                for n, g in self.accumulated.items():
                    self.live[n].add_(g, alpha=-self.lr)
            self.accumulated.clear()
            self.version += 1
        self.history = {v: w for v, w in self.history.items() if v >= oldest_needed}
        self.history.setdefault(self.version, self.snapshot())


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    warmup = min(stages - 1 - stage, microbatches)
    ops = [("F", m) for m in range(warmup)]
    for i in range(microbatches):
        if warmup + i < microbatches:
            ops.append(("F", warmup + i))
        ops.append(("B", i))
    return ops
