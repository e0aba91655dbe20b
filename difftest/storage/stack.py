"""The stack a run ran on: Python, OS, CPU (and the SIMD level torch's kernels use), GPUs, and the release of every
library a finding can live in. Recorded in run.json by `generate` and by every sweep, shown in findings.md and
report.html: a finding without its versions cannot be reported, and the same model can round differently on another
CPU (an AVX-512 and an AVX2 machine run different kernels)."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from difftest.storage.artifacts import atomic_write_text

# distributions whose releases a finding can depend on (CPU and CUDA builds both listed: the one installed shows)
LIBRARIES = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "tensorflow", "tensorflow-cpu", "keras", "tf2onnx",
             "onnx", "onnxruntime", "onnx2torch", "onnx2pytorch", "transformers", "timm", "torchtitan", "numpy", "ray")


FROM_CHECKOUT = "not installed (run from a checkout)"


def difftest_version() -> str:
    """This difftest's release; a checkout on PYTHONPATH (a GPU machine's, `benchmarks/`) has no metadata to read."""
    try:
        return metadata.version("difftest")
    except metadata.PackageNotFoundError:
        return FROM_CHECKOUT


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def current() -> dict[str, Any]:
    """This process's stack; torch is asked for the SIMD level its CPU kernels dispatch to and for its GPUs."""
    libraries = {}
    for name in LIBRARIES:
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    stack: dict[str, Any] = {"python": platform.python_version(), "os": platform.platform(),
                             "cpu": _cpu_model(), "libraries": libraries}
    try:
        import torch  # every difftest process has it (and has imported it already where it runs cases)
    except ImportError:
        return stack
    # the build as torch names it (`2.14.1+cu130`, `2.6.0+cpu`): the wheel's CUDA or CPU build, which the
    # distribution's metadata leaves out
    libraries["torch"] = torch.__version__
    try:
        stack["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        pass
    if torch.cuda.is_available():
        stack["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        stack["cuda"] = torch.version.cuda
    return stack


def record(run_file: Path) -> dict[str, Any] | None:
    """Put this process's stack into run.json under "stack"; a different stack recorded before moves to
    "earlier_stacks" and is returned, so the caller can say the run now mixes stacks."""
    raw = json.loads(run_file.read_text())
    now = current()
    before: dict[str, Any] | None = raw.get("stack")
    if before == now:
        return None
    if before is not None:
        raw.setdefault("earlier_stacks", []).append(before)
    raw["stack"] = now
    atomic_write_text(json.dumps(raw, indent=1, sort_keys=True), run_file)
    return before


def recorded(run_dir: Path) -> dict[str, Any]:
    try:
        recorded_stack: dict[str, Any] = json.loads((run_dir / "run.json").read_text()).get("stack", {})
    except (OSError, ValueError):
        return {}
    return recorded_stack


def describe(stack: dict[str, Any]) -> str:
    """One line: `Python 3.11.7 · Linux-… · AMD EPYC (AVX512) · torch 2.14.1+cu130, torchrec 1.9.2, …`."""
    if not stack:
        return "stack not recorded"
    cpu = stack.get("cpu", "?") + (f" ({stack['cpu_capability']})" if stack.get("cpu_capability") else "")
    gpus = f" · GPUs: {', '.join(stack['gpus'])} (CUDA {stack.get('cuda')})" if stack.get("gpus") else ""
    libraries = ", ".join(f"{k} {v}" for k, v in stack.get("libraries", {}).items())
    return f"Python {stack.get('python', '?')} · {stack.get('os', '?')} · {cpu}{gpus} · {libraries}"
