"""A damaged run folder never becomes "no findings": each kind of file truncated, bit-flipped and deleted, and what
the commands then do (difftest.storage.integrity, difftest.storage.verify).

The documented outcome of each cell: `analyze` stops with one line naming the damaged file (exit 2 in the CLI) and
writes nothing; then a model file is recreated by `generate` byte for byte, a case's outputs are uncommitted by
`verify --repair` and run again by `sweep`, and the run judges exactly as before. run.json and the store cannot be
recreated from the folder: their line says so (and where the last good store is kept).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from difftest.cli.main import app
from difftest.contracts.errors import UserError
from difftest.contracts.spec import RunConfig
from difftest.generation.generate import generate


def _cli(*args: str) -> tuple[int, str, BaseException | None]:
    """(exit code as `difftest` would give it, output, the exception) of a command run in this process."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    if isinstance(result.exception, UserError):
        return 2, str(result.exception), result.exception
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback: never a documented outcome
    return result.exit_code, result.output, None


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One DLRM-like model swept under the reference and its calibration runs, analysed."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    generate(run_dir, RunConfig(seed=0, models=1))
    code, output, _ = _cli("sweep", run_dir, "--settings", "reference,ddp/default/ws2", "--minimise-budget", "0")
    assert code == 0, output[-2000:]
    # the sweep's summary: one line (a log is read with grep), its counts by status name
    summary = [line for line in output.splitlines() if " already done, " in line]
    assert len(summary) == 1 and re.match(r"sweep: (\d+) cases, 0 already done, ran \1 \(ok=\1\) with \d+ worker group",
                                          summary[0]), output[-2000:]
    return run_dir


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_a_value(path: Path) -> None:
    """A bit of run.json's configuration (its learning rate), so that the file still reads as JSON."""
    data = path.read_bytes()
    _flip(path, data.index(b'"lr": ') + len(b'"lr": ') + 2)


DAMAGES: dict[str, Callable[[Path], None]] = {"truncated": _truncate, "bit-flipped": _flip,
                                                "deleted": lambda p: p.unlink()}
MODEL = "models/dlrm-s0-i0"


def _outputs_file(run_dir: Path) -> str:
    return next(p.relative_to(run_dir).as_posix() for p in sorted((run_dir / "outputs").rglob("*.safetensors"))
                if "__ddp__" in p.name or p.name.startswith("ddp"))


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("target", [f"{MODEL}/init.safetensors", f"{MODEL}/inputs.safetensors",
                                    f"{MODEL}/spec.json", "run.json", "store.sqlite", "outputs"])
def test_damage_is_one_line_nothing_is_overwritten_and_the_repair_restores_the_results(
        swept: Path, tmp_path: Path, target: str, damage: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(swept, run_dir)
    before = {name: (run_dir / name).read_bytes() for name in ("findings.md", "report.html", "comparisons.csv")}
    target = _outputs_file(run_dir) if target == "outputs" else target
    path = run_dir / target
    (_flip_a_value if target == "run.json" and damage == "bit-flipped" else DAMAGES[damage])(path)

    code, line, error = _cli("analyze", run_dir, "--minimise-budget", "0")
    assert code == 2 and error is not None, line
    assert "\n" not in line and (path.name in line or str(path.parent) in line), line
    # nothing derived from the damaged folder replaced what the last analysis wrote
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    if target.startswith("models/"):
        assert "difftest generate --out" in line
        code, output, _ = _cli("generate", "--out", run_dir)
        assert code == 0 and "recreated" in output, output
    elif target.startswith("outputs/"):
        assert "verify" in line and "--repair" in line
        assert _cli("verify", run_dir)[0] == 1
        code, output, _ = _cli("verify", run_dir, "--repair")
        assert code == 0 and "uncommitted" in output, output
        code, output, _ = _cli("sweep", run_dir, "--settings", "reference,ddp/default/ws2", "--minimise-budget", "0")
        assert code == 0 and "ran 1 " in output.replace("\n", " "), output[-1500:]
    elif target == "store.sqlite":
        assert "damaged" in line
        assert "store.last-good.sqlite" in line  # the analysis that wrote the files kept a good copy
        shutil.copy(run_dir / "store.last-good.sqlite", path)
    else:  # run.json: nothing in the folder recreates it
        assert "run.json" in line
        return
    assert _cli("verify", run_dir)[0] == 0
    code, output, _ = _cli("analyze", run_dir, "--minimise-budget", "0")
    assert code == 0, output[-1500:]
    assert (run_dir / "comparisons.csv").read_bytes() == before["comparisons.csv"]


def test_the_cli_says_one_line_and_exits_2_on_a_store_truncated_to_nothing(swept: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(swept, run_dir)
    (run_dir / "store.sqlite").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "difftest.cli", "analyze", str(run_dir)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"difftest: error: {run_dir / 'store.sqlite'} is damaged")
    assert "Traceback" not in done.stderr + done.stdout


def test_an_analysis_of_fewer_cases_keeps_the_last_ones_files(swept: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(swept, run_dir)
    findings = (run_dir / "findings.md").read_bytes()
    import sqlite3

    db = sqlite3.connect(run_dir / "store.sqlite")
    db.execute("DELETE FROM cases WHERE setting LIKE 'ddp/%'")
    db.commit()
    db.close()
    code, output, _ = _cli("analyze", run_dir, "--minimise-budget", "0")
    assert code == 0 and "fewer than the last one" in output, output[-1500:]
    kept = [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]
    assert len(kept) == 1 and (kept[0] / "findings.md").read_bytes() == findings
    assert pd.read_csv(kept[0] / "summary.csv")["cases"].sum() > pd.read_csv(run_dir / "summary.csv")["cases"].sum()


@pytest.mark.needs_tf
def test_a_damaged_onnx_export_is_named_and_generate_says_it_cannot_be_made_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1, kinds=("sequential",)))
    _flip(run_dir / "models" / "sequential-s0-i0" / "model.onnx")
    code, line, _ = _cli("sweep", run_dir, "--settings", "reference", "--minimise-budget", "0")
    assert code == 2 and "model.onnx: differs from the digest" in line and "byte for byte" in line, line
    assert not (run_dir / "store.sqlite").exists()  # nothing ran on it
    code, line, _ = _cli("generate", "--out", run_dir)
    assert code == 2 and "does not come out byte for byte" in line and "tf2onnx" in line, line


def test_bad_input_lines(swept: Path) -> None:
    code, line, _ = _cli("generate", "--out", swept.parent / "other", "--models-of", "foo=2")
    assert code == 2 and "no kind 'foo'" in line, line
    code, line, _ = _cli("diff", swept, swept)
    assert code == 2 and "given twice" in line, line
    code, output, _ = _cli("--version")
    assert code == 0 and output.startswith("difftest ") and "torch " in output, output
    code, output, _ = _cli("run", "--help")
    words = " ".join(output.split())  # the help is wrapped to the terminal's width, in boxes
    assert code == 0 and "(needs the [tf]" in words and "(the [ray]" in words, words  # not eaten as markup


_LEAVES_WITH_A_DEAF_RANK = """
import multiprocessing, signal, sys, time

def deaf_rank():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank started after the signal, waiting on peers that left
    time.sleep(600)

if __name__ == "__main__":
    rank = multiprocessing.get_context("spawn").Process(target=deaf_rank)
    rank.start()
    print(rank.pid, flush=True)
    time.sleep(1)
    from difftest.cli.main import _leave_interrupted
    _leave_interrupted()
"""


def test_leaving_after_ctrl_c_takes_the_ranks_a_sweep_started_along(tmp_path: Path) -> None:
    """The terminal gets its prompt back when difftest says it was interrupted: no rank it started (which shares
    its output) outlives it."""

    script = tmp_path / "leave.py"
    script.write_text(_LEAVES_WITH_A_DEAF_RANK)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    # returns once both pipes are closed by every process that held them (the rank would hold them for 600 s)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "difftest: interrupted" in stderr + stdout, stderr[-2000:]


@pytest.mark.heavy
def test_ctrl_c_is_one_line_that_says_how_to_resume_and_the_rerun_loses_nothing(tmp_path: Path) -> None:
    """Ctrl-C at a terminal signals the whole foreground process group: the sweep and its ranks."""
    import os
    import signal
    import time

    from tests.conftest import committed_cases

    run_dir = tmp_path / "run"
    generate(run_dir, RunConfig(seed=0, models=1))
    command = [sys.executable, "-m", "difftest.cli", "sweep", str(run_dir), "--settings", "torchrec/ebc/*/ws2",
               "--minimise-budget", "0"]
    # as a terminal's foreground job has it, whatever this test inherited (a shell's background job ignores SIGINT,
    # and difftest keeps a SIGINT its shell ignored ignored): a handler of this process's is the default after exec
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, inherited if inherited is not None else signal.SIG_DFL)
    deadline = time.monotonic() + 300
    while len(committed_cases(run_dir)) < 3 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    assert process.poll() is None, "the sweep finished before it could be interrupted"
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    done = len(committed_cases(run_dir))
    assert last.startswith("difftest: interrupted with ") and "the same command resumes" in last, stderr[-2000:]
    assert f"with {done} case(s)" in last and "Traceback" not in stderr, stderr[-3000:]
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f"{done} already done" in again.stderr.replace("\n", " "), again.stderr[-2000:]
