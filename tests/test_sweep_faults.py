"""Integration: real warm worker groups on gloo, planted faults, crash isolation, kill -9 and resume."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from difftest.contracts.status import Status
from difftest.findings import known
from difftest.judging.analysis import analyze
from difftest.runner.messages import CaseRequest
from difftest.runner.pool import CaseResult, WorkerGroup
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store
from tests.conftest import PLANTED, REFERENCE_CALIBRATIONS, committed_cases, sigkill_sweep_after

CLEAN_SINGLE_TYPE = [
    f"torchrec/ebc/{t}/ws2"
    for t in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
]


# the library bugs these settings show, where difftest/findings/known_issues.toml says the installed release has them
ROW_SCALING = "torchrec-rowwise-scaled-by-one-minus-2-pow-20"  # inside D3's allclose, past the envelope
GRID_MEAN = "torchrec-grid-mean"


def verdicts(run_dir: Path, column: str = "verdict") -> dict[tuple[str, str], str]:
    cases = analyze(run_dir).cases
    return {(r.model, r.setting): getattr(r, column) for r in cases.itertuples()}


def test_planted_faults_are_reported_and_clean_settings_are_not(fresh_run: Path) -> None:
    planted = ["faults/shard_off_by_one_row/ws2", "faults/rank1_skips_step/ws2"]
    selection = ",".join(["reference", *CLEAN_SINGLE_TYPE, *planted, "torchrec/ebc/grid_shard/ws2"])
    report = run_sweep(fresh_run, SweepOptions(settings=selection, plugins=(PLANTED,), timeout_s=120))
    assert set(report.statuses) == {"ok"} and report.statuses["ok"] == report.total  # calibration runs included
    judged, d3 = verdicts(fresh_run), verdicts(fresh_run, "d3_verdict")
    models = {m for m, _ in judged}
    assert len(models) == 2
    for model in models:
        for setting in planted:
            assert judged[(model, setting)] == d3[(model, setting)] == "inconsistent", (model, setting)
        for setting in CLEAN_SINGLE_TYPE:
            assert d3[(model, setting)] == "ok", (model, setting)
            scaled = known.match(setting, "inconsistent", "", {"torchrec"}, "ok") == known.get(ROW_SCALING)
            if not scaled or known.reproduces_here(ROW_SCALING):
                assert judged[(model, setting)] == ("inconsistent" if scaled else "ok"), (model, setting)
    # grid_shard sums per-row-shard means: both default models have MEAN tables whose bags span row shards
    if known.reproduces_here(GRID_MEAN):
        assert {judged[(m, "torchrec/ebc/grid_shard/ws2")] for m in models} == {"inconsistent"}
    rows = analyze(fresh_run).inconsistencies
    skipped = rows[rows.setting == "faults/rank1_skips_step/ws2"]
    assert set(skipped.phase) == {"eval_after_step1"}  # rank 0's parameters are right; rank 1's predictions are not


@pytest.mark.timeout(300)  # the hanging rank sleeps an hour: only its 15 s case timeout ends it
def test_raise_abort_hang_and_refusal_become_rows_and_the_sweep_finishes(fresh_run: Path) -> None:
    selection = "faults/raises/ws2,faults/aborts/ws2,faults/hangs/ws2,faults/refuses/ws2,torchrec/ebc/table_wise/ws2"
    report = run_sweep(fresh_run, SweepOptions(settings=selection, models="*-i0", plugins=(PLANTED,), timeout_s=15))
    store = Store(fresh_run)
    records = {r.setting: r for r in store.records()}
    store.close()
    assert records["faults/raises/ws2"].status == "error"
    assert "planted failure on rank 1" in records["faults/raises/ws2"].message
    assert records["faults/raises/ws2"].rank == 1
    assert records["faults/aborts/ws2"].status == "crash"
    assert "SIGABRT" in records["faults/aborts/ws2"].message and records["faults/aborts/ws2"].rank == 1
    assert "planted.py" in records["faults/aborts/ws2"].message  # the Python frame it died in (faulthandler)
    assert records["faults/hangs/ws2"].status == "timeout"
    assert "no answer from rank(s)" in records["faults/hangs/ws2"].message  # rank 0 waits in its barrier too
    assert records["faults/refuses/ws2"].status == "unsupported"
    assert "planted refusal" in records["faults/refuses/ws2"].message
    assert records["torchrec/ebc/table_wise/ws2"].status == "ok"  # the sweep went on after all of them
    assert records["reference"].status == "ok"  # brought in: the settings above are judged against it
    assert sum(report.statuses.values()) == 6 + REFERENCE_CALIBRATIONS


@pytest.mark.timeout(300)
def test_a_rank_killed_by_what_an_earlier_case_left_runs_its_case_again_alone(fresh_run: Path) -> None:
    """A rank that dies only because its process ran another case first (planted: rank 1 aborts where its process
    has run either setting before) is not the setting's crash: the case runs again alone in a fresh group, its verdict
    is that run's, and its message keeps the first death."""
    selection = "faults/aborts_when_reused/ws2,faults/aborts_when_reused_too/ws2"
    run_sweep(fresh_run, SweepOptions(settings=selection, plugins=(PLANTED,), timeout_s=30, jobs=1))
    store = Store(fresh_run)
    records = [r for r in store.records() if r.setting.startswith("faults/")]
    store.close()
    assert len(records) == 4 and {r.status for r in records} == {"ok"}, [(r.status, r.message) for r in records]
    noted = [r for r in records if "harness: in a worker group that had run" in r.message]
    assert noted and all("SIGABRT" in r.message and "did not crash" in r.message for r in noted), noted
    assert len(noted) < len(records)  # a case that ran first in its group never died


class _ScriptedGroup:
    """A worker group for `GroupRunner`'s rule alone: a case's setting name says when a rank dies (`dies-always`,
    `dies-when-reused`: once its processes have run a case before); `ok` notes a plan, as a setting's notes are kept."""

    started: ClassVar[list[_ScriptedGroup]] = []
    fail_to_start_after = 99  # groups that start before one fails to

    def __init__(self, *args: object, **kwargs: object) -> None:
        from difftest.runner.pool import GroupStartError

        if len(self.started) >= self.fail_to_start_after:
            raise GroupStartError("planted: no group starts")
        self.cases_run, self.killed = 0, False
        self.started.append(self)

    def run_case(self, request: CaseRequest, timeout_s: float) -> CaseResult:
        self.cases_run += 1
        reused = self.cases_run > 1
        dies = request.setting == "dies-always" or (request.setting.startswith("dies-when-reused") and reused)
        if dies:
            return CaseResult(Status.CRASH, message="rank 1 killed by SIGSEGV (exit -11); log: heap damage",
                              rank=1, wall_s=1.0, reusable=False)
        if request.setting == "dies-when-reused-else-raises":
            return CaseResult(Status.ERROR, message="ValueError: planted || File \"x.py\", line 1, in f", rank=0,
                              wall_s=1.0)
        return CaseResult(Status.OK, message="plan: t0=row_wise; graphs compiled: 2", wall_s=1.0)

    def kill(self) -> None:
        self.killed = True

    close = kill


@pytest.fixture
def scripted_groups(monkeypatch: pytest.MonkeyPatch) -> type[_ScriptedGroup]:
    import difftest.runner.local as local

    monkeypatch.setattr(_ScriptedGroup, "started", [])
    monkeypatch.setattr(local, "WorkerGroup", _ScriptedGroup)
    return _ScriptedGroup


def _groups_used(groups: type[_ScriptedGroup]) -> int:
    """The groups that ran a case (a spare started in the background may not have)."""
    return sum(1 for group in groups.started if group.cases_run)


def _runner(tmp_path: Path, group: object = None) -> Any:
    from difftest.runner.local import GroupRunner

    return GroupRunner(2, tmp_path / "logs", (), device="cpu", backend="gloo", timeout_s=30, recycle_after=2000,
                       group=group)  # type: ignore[arg-type]


def test_a_death_after_other_cases_is_judged_by_the_case_run_alone(tmp_path: Path, scripted_groups) -> None:
    """A rank that dies after its group ran another case: the case runs again alone, in a fresh group; it runs
    through there, so its verdict is ok, its own notes kept and the first death added as a note of its own."""
    from difftest.contracts.notes import parse_notes

    runner = _runner(tmp_path)
    assert runner.run(_request("m", "ok"), "").status is Status.OK
    result = runner.run(_request("m", "dies-when-reused"), "")
    runner.close()
    assert result.status is Status.OK and _groups_used(scripted_groups) == 2, result
    notes = parse_notes(result.message)
    assert notes["plan"] == "t0=row_wise" and notes["graphs compiled"] == "2", notes
    assert "had run 1 case(s) before it, rank 1 killed by SIGSEGV (exit -11)" in notes["harness"], notes
    assert result.wall_s == 2.0  # both runs' time: the case cost both


def test_a_death_the_case_shows_alone_too_is_its_crash(tmp_path: Path, scripted_groups) -> None:
    runner = _runner(tmp_path)
    assert runner.run(_request("m", "ok"), "").status is Status.OK
    result = runner.run(_request("m", "dies-always"), "")
    assert result.status is Status.CRASH and "harness" not in result.message and _groups_used(scripted_groups) == 2
    first = runner.run(_request("m", "dies-always"), "")  # on a fresh group: its first case, not run again
    runner.close()
    assert first.status is Status.CRASH and _groups_used(scripted_groups) == 3


def test_a_failure_alone_is_the_settings_own_and_carries_no_note(tmp_path: Path, scripted_groups) -> None:
    """Run alone, the case raises: its error, in its own words, is the verdict (a note would enter the failure's frames
    and the signature made of them)."""
    runner = _runner(tmp_path)
    assert runner.run(_request("m", "ok"), "").status is Status.OK
    result = runner.run(_request("m", "dies-when-reused-else-raises"), "")
    runner.close()
    assert result.status is Status.ERROR and result.message == 'ValueError: planted || File "x.py", line 1, in f'
    assert _groups_used(scripted_groups) == 2


def test_a_warm_groups_earlier_cases_count_and_a_group_that_cannot_start_leaves_the_first_death(
        tmp_path: Path, scripted_groups, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group handed over warm (the minimiser's rounds) has run cases before the runner's first; where no fresh
    group starts for the rerun, the case keeps its first death rather than the start's failure."""
    warm = scripted_groups()
    warm.cases_run = 5
    runner = _runner(tmp_path, group=warm)
    assert runner.run(_request("m", "dies-when-reused"), "").status is Status.OK
    runner.close()
    spent = scripted_groups()  # a warm group past its case budget is recycled before the runner's first case
    spent.cases_run = 2000
    runner = _runner(tmp_path, group=spent)
    assert runner.run(_request("m", "ok"), "").status is Status.OK and spent.killed and spent.cases_run == 2000
    runner.close()
    monkeypatch.setattr(scripted_groups, "started", [])
    monkeypatch.setattr(scripted_groups, "fail_to_start_after", 1)
    runner = _runner(tmp_path)
    assert runner.run(_request("m", "ok"), "").status is Status.OK
    result = runner.run(_request("m", "dies-when-reused"), "")
    runner.close()
    assert result.status is Status.CRASH and "SIGSEGV" in result.message and "worker group" not in result.message


def _outputs(run_dir: Path) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    store = Store(run_dir)
    try:
        return {(r.model, r.setting): store.load_outputs(r) for r in store.records() if r.outputs}
    finally:
        store.close()


@pytest.mark.e2e  # the CLI killed with SIGKILL and run again: end to end
def test_sigkill_mid_sweep_then_rerun_resumes_to_the_same_results(fresh_run: Path, tmp_path: Path) -> None:
    selection = "reference,torchrec/ebc/*/ws2,torchrec/ebc/table_wise/ws3,torchrec/ebc/row_wise/ws3"
    command = [sys.executable, "-m", "difftest.cli", "sweep", str(fresh_run), "--settings", selection]
    temporary = tmp_path / "tmp"  # where the killed sweep's worker groups keep their temporary folders
    temporary.mkdir()
    made: list[Path] = []  # the running sweep's group folders: the test below is empty-handed without them
    sigkill_sweep_after(command, fresh_run, 6, deadline_s=240, env={**os.environ, "TMPDIR": str(temporary)},
                        before_kill=lambda: made.extend(temporary.glob("difftest-ws*")))
    assert made, "the sweep's worker groups made no folder in its TMPDIR"
    interrupted_at = len(committed_cases(fresh_run))
    total = 2 * (1 + 10 + 2 + REFERENCE_CALIBRATIONS)  # + the reference's calibration runs
    assert 6 <= interrupted_at < total

    # the ranks of the killed sweep see its pipes close and remove their groups' folders, as it no longer can
    import time

    for _ in range(100):
        if not list(temporary.glob("difftest-ws*")):
            break
        time.sleep(0.2)
    assert not list(temporary.glob("difftest-ws*")), list(temporary.iterdir())
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    with sqlite3.connect(fresh_run / "store.sqlite") as db:
        rows = db.execute("SELECT model, setting, status FROM cases").fetchall()
    assert len(rows) == total == len({(m, s) for m, s, _ in rows})  # nothing lost, nothing twice
    assert {s for _, _, s in rows} == {"ok"}

    # the resumed result set equals an uninterrupted sweep's, byte for byte
    uninterrupted = tmp_path / "uninterrupted"
    import shutil

    shutil.copytree(fresh_run, uninterrupted, ignore=shutil.ignore_patterns("store.sqlite*", "outputs", "logs"))
    run_sweep(uninterrupted, SweepOptions(settings=selection))
    resumed, clean = _outputs(fresh_run), _outputs(uninterrupted)
    assert resumed.keys() == clean.keys()
    for key in clean:
        assert resumed[key].keys() == clean[key].keys()
        for name in clean[key]:
            assert np.array_equal(resumed[key][name], clean[key][name]), (key, name)


PROBE = "torchrec/ebc/row_wise/ws2"


def _request(model_dir: str, setting: str) -> CaseRequest:
    return CaseRequest(model_dir, setting, steps=1, lr=0.1, seed=0)


def _model_dirs(run_dir: Path) -> list[str]:
    return sorted(str(d) for d in (run_dir / "models").iterdir())


def _probe_in_a_fresh_group(run_dir: Path) -> dict[str, np.ndarray]:
    from difftest.contracts.registry import load_plugins

    fresh = WorkerGroup(2, run_dir / "logs", load_plugins((PLANTED,)))
    try:
        first = fresh.run_case(_request(_model_dirs(run_dir)[0], PROBE), 120)
    finally:
        fresh.close()
    assert first.status == "ok"
    return first.outputs


def _assert_same_bytes(first: dict[str, np.ndarray], later: dict[str, np.ndarray]) -> None:
    assert first.keys() == later.keys()
    for name in first:
        assert first[name].tobytes() == later[name].tobytes(), name


def test_a_case_gives_the_same_bytes_first_in_a_fresh_group_and_after_other_cases(fresh_run: Path) -> None:
    from difftest.contracts.registry import load_plugins

    first = _probe_in_a_fresh_group(fresh_run)
    model_dirs = _model_dirs(fresh_run)
    warm = WorkerGroup(2, fresh_run / "logs", load_plugins())
    try:
        for setting in ("torchrec/ebc/data_parallel/ws2", "torchrec/ebc/mixed-s0/ws2", "torchrec/ebc/planner/ws2"):
            for model_dir in reversed(model_dirs):
                assert warm.run_case(_request(model_dir, setting), 120).status == "ok"
        later = warm.run_case(_request(model_dirs[0], PROBE), 120)
    finally:
        warm.close()
    assert later.status == "ok"
    _assert_same_bytes(first, later.outputs)


def test_a_failed_case_leaves_the_group_in_step_and_the_next_case_gives_a_fresh_groups_bytes(fresh_run: Path) -> None:
    """A rank that raises while its peer waits on it (in a barrier; in a pipeline's pending receive, a real torch
    failure) costs what a passing case costs: the peer is cut loose at once, the same processes run the next case."""
    from difftest.contracts.registry import load_plugins

    first = _probe_in_a_fresh_group(fresh_run)
    model_dir = _model_dirs(fresh_run)[0]
    warm = WorkerGroup(2, fresh_run / "logs", load_plugins((PLANTED,)))
    try:
        pids = [p.pid for p in warm.processes]
        failing = [("faults/raises/ws2", "planted failure on rank 1")]
        if known.reproduces_here("pipelining-zbv-eval"):  # a real torch failure, while this torch has it
            failing.append(("pipeline/zbv-zero-bubble/ws2/stages4/mb2/balanced", "steal_bwd_input"))
        for setting, needle in failing:
            failed = warm.run_case(_request(model_dir, setting), 120)
            assert failed.status == "error" and needle in failed.message, failed.message
            assert failed.rank == 1  # the rank that failed first, not the peer whose receive was cut
            assert failed.reusable  # its peers reported within the grace and the group stays in step
        later = warm.run_case(_request(model_dir, PROBE), 120)
        assert [p.pid for p in warm.processes] == pids and warm.alive
    finally:
        warm.close()
    assert later.status == "ok"
    _assert_same_bytes(first, later.outputs)


def test_what_ranks_leave_in_the_temporary_folder_goes_with_their_group_closed_or_crashed(fresh_run: Path) -> None:
    """Ranks leave through os._exit (or are killed), so a library's delete-at-exit never runs: TensorFlow's autograph
    left a source file in /tmp per converted function, 42 on a sweep of 48 Keras cases. The group's folder holds them."""
    from difftest.contracts.registry import load_plugins

    model_dir, plugins = _model_dirs(fresh_run)[0], load_plugins((PLANTED,))
    for ending in ("close", "crash"):
        group = WorkerGroup(2, fresh_run / "logs", plugins)
        try:
            probe = group.run_case(_request(model_dir, "probes/leaves_temp_file"), 120)
            assert probe.status == "ok", probe.message
            left = Path(probe.outputs["path/utf8"].tobytes().decode())
            assert left.read_bytes() == b"left behind" and left.parent == Path(group.temp_dir)
            if ending == "crash":
                assert group.run_case(_request(model_dir, "faults/aborts/ws2"), 120).status == "crash"
        finally:
            group.close()
        assert not left.exists() and not Path(group.temp_dir).exists(), ending


def _probe(fresh_run: Path, setting: str, world_size: int) -> Any:
    """A planted probe setting's result in a fresh group of `world_size` ranks."""
    from difftest.contracts.registry import load_plugins

    group = WorkerGroup(world_size, fresh_run / "logs", load_plugins((PLANTED,)))
    try:
        probe = group.run_case(_request(_model_dirs(fresh_run)[0], setting), 120)
    finally:
        group.close()
    assert probe.status == "ok", probe.message
    return probe


def test_a_cases_gloo_connections_are_on_the_loopback(fresh_run: Path, monkeypatch: Any) -> None:
    """Ranks meet at 127.0.0.1, but gloo binds its connections to the address the host name resolves to: a network
    interface where /etc/hosts does not name the host (after a DNS lookup). The ranks name the loopback for it (the
    store's server from torch 2.11 on: this stack's)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the user's own choice would win
    probe = _probe(fresh_run, "probes/gloo_addresses", 2)
    interface, addresses = probe.outputs["addresses/utf8"].tobytes().decode().split("|")
    assert interface == "lo"
    assert addresses and set(addresses.split(",")) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, addresses


def test_cpu_ranks_and_the_processes_they_start_see_no_gpu(fresh_run: Path, monkeypatch: Any) -> None:
    """The import server hides the GPUs before torch is imported: TorchRec's and fbgemm's CPU paths asked CUDA for
    streams where a GPU was in reach, and ranks forked from a server that had touched CUDA failed every such case on
    a GPU machine. The user's own CUDA_VISIBLE_DEVICES does not reach a CPU rank either."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    probe = _probe(fresh_run, "probes/visible_gpus", 1)
    assert probe.outputs["rank/utf8"].tobytes() == probe.outputs["started/utf8"].tobytes() == b"none"


def test_a_plugin_raising_connection_error_in_a_rank_is_that_ranks_error_not_its_parent_leaving(tmp_path: Path) -> None:
    """Only the pipe to the parent failing means the parent is gone (the rank leaves quietly, exit 0): any other
    ConnectionError is the rank's own failure, with its traceback in the log the start error quotes."""
    from difftest.runner.pool import GroupStartError

    with pytest.raises(GroupStartError) as raised:
        WorkerGroup(1, tmp_path / "logs", ("tests.faults.unreachable_in_ranks",), start_timeout_s=120)
    assert "rank 0 exited with code 1 while starting" in str(raised.value), raised.value
    assert "ConnectionRefusedError: the feature store at 127.0.0.1:9 refused the connection" in str(raised.value)


def test_after_a_crash_the_next_case_runs_on_a_replacement_and_gives_a_fresh_groups_bytes(fresh_run: Path) -> None:
    first = _probe_in_a_fresh_group(fresh_run)
    order: list[str] = []
    report = run_sweep(fresh_run, SweepOptions(settings=f"faults/aborts/ws2,{PROBE}", models="*-i0",
                                               plugins=(PLANTED,), timeout_s=60, jobs=1),
                       on_result=lambda case, record: order.append(record.setting))
    assert order.index("faults/aborts/ws2") < order.index(PROBE)
    assert report.statuses == {"crash": 1, "ok": 2 + REFERENCE_CALIBRATIONS}  # the probe, its reference, calibrations
    assert report.groups_started == 3  # ws1 for the reference; ws2, and its replacement after the crash
    store = Store(fresh_run)
    try:
        record = next(r for r in store.records() if r.setting == PROBE)
        _assert_same_bytes(first, store.load_outputs(record))
    finally:
        store.close()


def test_a_group_is_recycled_after_its_case_budget_and_the_results_do_not_change(fresh_run: Path, tmp_path: Path) -> None:
    import shutil

    models = sorted(p.name for p in (fresh_run / "models").iterdir())
    # the cases and their references, not the calibration runs: nothing here is judged
    pairs = tuple((m, s) for m in models for s in ("torchrec/ebc/table_wise/ws2", "torchrec/ebc/row_wise/ws2"))
    twin = tmp_path / "twin"
    shutil.copytree(fresh_run, twin)
    recycled = run_sweep(fresh_run, SweepOptions(pairs=pairs, calibrated_pairs=(), recycle_after=2, jobs=1))
    assert recycled.statuses == {"ok": 6}
    # a group per 2 cases: one runs the 2 references (one rank), two the 4 sharded cases (two ranks)
    assert recycled.groups_started == 1 + 2
    kept = run_sweep(twin, SweepOptions(pairs=pairs, calibrated_pairs=(), jobs=1))
    assert kept.groups_started == 2
    first, second = _outputs(fresh_run), _outputs(twin)
    assert first.keys() == second.keys()
    for key in first:
        _assert_same_bytes(first[key], second[key])


def test_groups_side_by_side_give_the_bytes_one_group_gives(fresh_run: Path, tmp_path: Path) -> None:
    """The scheduler decides where a case runs, never what it computes: two groups at once (one of them moving to the
    other's bucket when its own is done) give byte for byte what one group gives running every case in turn."""
    import shutil

    selection = "reference,ddp/default/ws2,accumulate/mb2,torchrec/ebc/row_wise/ws2"
    twin = tmp_path / "twin"
    shutil.copytree(fresh_run, twin)
    alone = run_sweep(fresh_run, SweepOptions(settings=selection, jobs=1))
    side_by_side = run_sweep(twin, SweepOptions(settings=selection, jobs=2))
    assert alone.statuses == side_by_side.statuses and set(alone.statuses) == {"ok"}
    first, second = _outputs(fresh_run), _outputs(twin)
    assert first.keys() == second.keys()
    for key in first:
        _assert_same_bytes(first[key], second[key])


@pytest.mark.timeout(240)  # peers that waited for the group that is gone would wait for ever
def test_an_error_of_ours_while_recording_a_case_ends_the_sweep_with_that_error(fresh_run: Path) -> None:
    """A worker thread that raises (here: in the callback the store commits through) is not lost: the sweep raises it,
    and its peers stop instead of waiting for a group that is gone."""
    def broken(case, record) -> None:
        raise RuntimeError("planted: recording failed")

    with pytest.raises(RuntimeError, match="planted: recording failed"):
        run_sweep(fresh_run, SweepOptions(settings="reference,ddp/default/ws2", models="*-i0", jobs=2),
                  on_result=broken)


def test_a_rank_not_yet_reaped_or_whose_status_was_lost_is_described_by_the_signal_its_faulthandler_report_names(tmp_path: Path) -> None:
    """On a loaded host a rank killed by SIGFPE was once not reaped within the wait and recorded as "vanished": a
    second finding for one bug. Its log's faulthandler report names the signal, and the rank then exits with it."""
    from difftest.runner.pool import _describe_exit

    log = tmp_path / "rank0.log"
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-X", "faulthandler", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGFPE)"],
                              stderr=out, check=False).returncode
    assert "Fatal Python error: Floating point exception" in log.read_text()
    assert _describe_exit(code) == _describe_exit(None, log) == "killed by SIGFPE (exit -8)"
    assert _describe_exit(255, log) == "killed by SIGFPE (exit -8)"  # the forkserver lost the status: the log says
    assert _describe_exit(255, tmp_path / "missing.log") == "exited with code 255"
    assert _describe_exit(None, tmp_path / "missing.log") == "vanished"


def _start_through_import_server(answers: Any) -> None:
    """In a rank forked from the CPU ranks' import server: start a process as a resume phase does, and say whose
    child it is and whether this rank started a fork server of its own."""
    from multiprocessing import forkserver

    from difftest.runner.pool import import_server

    child = import_server().Process(target=_say_parent, args=(answers,))
    child.start()
    child.join()
    answers.put((os.getppid(), child.exitcode, forkserver._forkserver._forkserver_pid))


def _say_parent(answers: Any) -> None:
    answers.put(os.getppid())


def test_a_rank_starts_its_processes_from_the_import_server_it_was_forked_from() -> None:
    """A resume case's phases fork from the server the sweep's ranks fork from: a server of the rank's own would
    import torch and the plugins again (3 s a rank on 2 cores), the old behaviour, which this test fails on."""
    from difftest.runner.pool import rank_start

    context = rank_start("cpu", gpu_in_ranks=False)
    answers = context.SimpleQueue()
    rank = context.Process(target=_start_through_import_server, args=(answers,))
    rank.start()
    rank.join(120)
    child_parent, (server, exitcode, own_server) = answers.get(), answers.get()
    assert rank.exitcode == 0 and exitcode == 0
    assert own_server is None  # CPython's own `ensure_running` would have started (and recorded) one
    assert child_parent == server != os.getpid()  # the rank's child is the server's, as the rank is


def test_ranks_fork_from_the_import_server_unless_their_settings_may_use_a_gpu_in_reach(monkeypatch: Any) -> None:
    """On a GPU machine a CPU sweep's ranks used to be spawned, each importing torch and the plugins itself (the
    16-core machine's groups paid seconds each): only a setting that computes on the GPU needs that, and it has a
    bucket of its own."""
    import difftest.contracts.devices
    from difftest.contracts.registry import get_setting, load_plugins
    from difftest.runner.pool import forks_from_import_server

    load_plugins()
    plain, on_gpu, rerun_on_gpu = (get_setting(name) for name in ("reference", "cuda/reference",
                                                                    "rerun/cuda/reference"))
    assert not plain.computes_on_gpu and on_gpu.computes_on_gpu and rerun_on_gpu.computes_on_gpu
    assert on_gpu.process_affinity != plain.process_affinity  # never one bucket, so never one group
    assert rerun_on_gpu.process_affinity == on_gpu.process_affinity
    for gpus in (0, 1):
        monkeypatch.setattr(difftest.contracts.devices, "visible_gpus", lambda gpus=gpus: gpus)
        assert forks_from_import_server("cpu", gpu_in_ranks=False)
        assert forks_from_import_server("cpu", gpu_in_ranks=True) == (gpus == 0)
        assert not forks_from_import_server("cuda", gpu_in_ranks=False)
