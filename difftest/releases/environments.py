"""The torch releases difftest supports, and an environment per release for `difftest bisect`.

The table lives in `releases.toml` beside this file (install.sh reads it too). An environment is a uv virtualenv
under a cache folder the user can set (`--cache` or `$DIFFTEST_STACKS`), holding one release's torch with the
fbgemm-gpu and torchrec built for it, and this checkout of difftest installed editable without its dependencies,
so a finding's minimal case runs there through the same engine. Environments are made once, under a lock, in a
temporary folder renamed into place when complete: two bisects sharing the cache never see a half-made one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from packaging.version import InvalidVersion, Version

from difftest.contracts.errors import UserError

TABLE = Path(__file__).with_name("releases.toml")
CACHE_VARIABLE = "DIFFTEST_STACKS"
READY_FILE = "difftest-stack.json"  # written last: an environment without it was never finished
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Release:
    torch: str
    fbgemm: str
    torchrec: str
    torchvision: str

    @property
    def minor(self) -> tuple[int, int]:
        return Version(self.torch).release[:2]  # type: ignore[return-value]

    def packages(self, gpu: bool) -> tuple[list[str], list[str]]:
        """(installed with their dependencies, installed without): torchrec's metadata asks for the CUDA
        fbgemm-gpu, which does not load without a GPU driver, so it comes without, beside the build that fits."""
        fbgemm = f"fbgemm-gpu=={self.fbgemm}" if gpu else f"fbgemm-gpu-cpu=={self.fbgemm}"
        return [f"torch=={self.torch}", fbgemm], [f"torchrec=={self.torchrec}"]


@cache
def supported() -> tuple[Release, ...]:
    table = tomllib.loads(TABLE.read_text())
    return tuple(sorted((Release(**row) for row in table["release"]), key=lambda r: Version(r.torch)))


def supported_range() -> str:
    releases = supported()
    return f"torch {releases[0].torch} to {releases[-1].torch} ({', '.join(r.torch for r in releases)})"


def release(text: str) -> Release:
    """`2.10`, `2.10.0` or `2.9.0` (another patch of a supported line keeps that line's fbgemm and torchrec)."""
    try:
        wanted = Version(text.strip())
    except InvalidVersion:
        raise UserError(f"torch release {text!r} is not a version; difftest supports {supported_range()}") from None
    for known in supported():
        if known.minor == wanted.release[:2]:
            if len(wanted.release) < 3 or Version(known.torch) == wanted:
                return known
            return Release(str(wanted), known.fbgemm, known.torchrec, known.torchvision)
    raise UserError(f"torch {text} is not supported; difftest supports {supported_range()}")


def release_range(text: str) -> list[Release]:
    """`2.6.0..2.14.1` (both ends included, every supported line between), or a comma-separated list."""
    if ".." in text:
        low, high = (release(part) for part in text.split("..", 1))
        if Version(low.torch) > Version(high.torch):
            raise UserError(f"torch range {text!r} runs backwards; write the older release first")
        between = [r for r in supported() if low.minor < r.minor < high.minor]
        return [low, *between, high] if low != high else [low]
    return [release(part) for part in text.split(",") if part.strip()]


def installed(rel: Release) -> bool:
    """Whether this python already has `rel`'s torch and torchrec (then it needs no environment of its own)."""
    from importlib import metadata

    try:
        return metadata.version("torch").split("+")[0] == rel.torch and metadata.version("torchrec") == rel.torchrec
    except metadata.PackageNotFoundError:
        return False


def default_cache() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "difftest" / "stacks")


def has_gpu() -> bool:
    nvidia_smi = shutil.which("nvidia-smi")
    return bool(nvidia_smi) and subprocess.run([nvidia_smi or "", "-L"], capture_output=True).returncode == 0


def _uv() -> str:
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin
    except ImportError:
        raise UserError("bisect makes its environments with uv, which is not installed: pip install uv") from None
    return str(find_uv_bin())


class EnvironmentUnavailable(Exception):
    """A release's environment could not be made here (no network, no matching wheel): says why, in one line."""


def _last_lines(text: str, keep: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-keep:])[:400]


def environment(rel: Release, cache_dir: Path | None = None, log: Callable[[str], None] = lambda _: None) -> Path:
    """The python of `rel`'s environment, made first if the cache has none."""
    cache_dir = (cache_dir or default_cache()).expanduser().resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    gpu = has_gpu()
    name = f"torch-{rel.torch}-{'cuda' if gpu else 'cpu'}"
    final = cache_dir / name
    python = final / "bin" / "python"
    if (final / READY_FILE).exists():
        return python
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second bisect waits here, then finds the environment made
        if (final / READY_FILE).exists():
            return python
        if final.exists():  # a folder without READY_FILE is not ours to trust (an older layout, a manual copy)
            shutil.rmtree(final)
        building = cache_dir / f".{name}.building"
        shutil.rmtree(building, ignore_errors=True)
        log(f"making the environment for torch {rel.torch} in {final} (once; later bisects reuse it)")
        with_deps, without_deps = rel.packages(gpu)
        uv = _uv()
        steps = [
            [uv, "venv", "--quiet", "--python", sys.executable, str(building)],
            # difftest's own dependencies resolve against the pinned torch; difftest itself is this checkout
            [uv, "pip", "install", "--quiet", "--python", str(building / "bin" / "python"), *with_deps,
             "-e", str(PROJECT_ROOT)],
            [uv, "pip", "install", "--quiet", "--python", str(building / "bin" / "python"), "--no-deps",
             *without_deps],
            # what that torchrec release itself needs at run time (torchrec 1.1 still imports iopath)
            [str(building / "bin" / "python"), "-m", "difftest.releases.environments", "torchrec-requirements"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                shutil.rmtree(building, ignore_errors=True)
                raise EnvironmentUnavailable(f"`{' '.join(step[1:3])}` failed: {_last_lines(done.stderr)}")
            if step[1:] == ["-m", "difftest.releases.environments", "torchrec-requirements"] and done.stdout.split():
                steps.append([uv, "pip", "install", "--quiet", "--python", str(building / "bin" / "python"),
                              *done.stdout.split()])
        record = {**asdict(rel), "fbgemm_package": with_deps[1].split("==")[0], "python": sys.version.split()[0]}
        (building / READY_FILE).write_text(json.dumps(record, indent=1))
        building.rename(final)
    return python


def torchrec_requirements() -> list[str]:
    """The installed torchrec's own run-time requirements but fbgemm-gpu (the build that fits is there already)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    wanted = []
    for text in metadata.requires("torchrec") or []:
        requirement = Requirement(text)
        if requirement.name.startswith("fbgemm") or (requirement.marker and not requirement.marker.evaluate()):
            continue
        wanted.append(str(requirement).split(";")[0].replace(" ", ""))
    return wanted


if __name__ == "__main__" and sys.argv[1:] == ["torchrec-requirements"]:  # install.sh and `environment` use it
    print(" ".join(torchrec_requirements()))
