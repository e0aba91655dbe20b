"""The Ray executor: the same results as the local one, byte for byte; node loss re-runs cases, never loses or
doubles one; a driver killed with SIGKILL resumes. The multi-node tests run on a cluster simulated on this machine
(`ray.cluster_utils.Cluster`: a head without CPUs, two worker nodes of four logical CPUs each)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter, deque
from pathlib import Path

import pytest

from difftest.contracts.errors import UserError
from difftest.contracts.status import Status
from difftest.runner.executor import ExecutorConfig
from difftest.runner.sweep import SweepOptions, run_sweep
from difftest.storage.store import Store, results_digest
from tests.conftest import PLANTED, committed_cases, sigkill_sweep_after

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

# two world sizes, so gangs of two and of four ranks share the cluster
SELECTION = "ddp/*/ws2,torchrec/ebc/row_wise/ws2,fsdp2/*/ws4"


def _copy_unswept(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("store.sqlite*", "outputs", "logs"))
    return target


def _descends_from_this_test(pid: int) -> bool:
    """Whether `pid` was started, through any number of parents, by this process (the Ray it started itself)."""
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _kill_a_gang_host() -> int | None:
    """SIGKILL the process of a running gang's host actor (Ray names it in its process title) of the Ray instance
    this test started, never another one on the machine; its pid, or None."""
    for entry in os.listdir("/proc"):
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if entry.isdigit() and title.startswith("ray::GangHost") and _descends_from_this_test(int(entry)):
            os.kill(int(entry), signal.SIGKILL)
            return int(entry)
    return None


@pytest.mark.ray
def test_ray_gangs_give_the_local_executors_bytes_and_tell_a_lost_host_from_a_crash(fresh_run: Path,
                                                                                    tmp_path: Path) -> None:
    """Ray started on this machine: clean cases, ranks that raise, abort and hang, and a gang host killed mid-sweep
    (its worker process lost: infrastructure) — crash, error and timeout rows are the cases' own and not retried,
    the lost host's case runs again on a new gang, and every row is the local executor's, byte for byte."""
    selection = "ddp/*/ws2,faults/raises/ws2,faults/aborts/ws2,faults/hangs/ws2"
    options = SweepOptions(settings=selection, models="*-i0", plugins=(PLANTED,), timeout_s=10)
    local = _copy_unswept(fresh_run, tmp_path / "local")
    run_sweep(local, options)
    seen: Counter = Counter()
    killed: list = []

    def on_result(case, record) -> None:
        seen[(record.model, record.setting)] += 1
        # after a case that ran on a gang (a refusal, decided before any gang starts, leaves none to kill)
        if case.setting.world_size == 2 and record.status != Status.UNSUPPORTED and not killed:
            killed.append(_kill_a_gang_host())

    report = run_sweep(fresh_run, dataclasses.replace(options, executor=ExecutorConfig("ray")), on_result=on_result)
    expected, got = results_digest(local), results_digest(fresh_run)
    assert got == expected
    assert set(seen) == set(got) and set(seen.values()) == {1}  # every case reported once, and committed
    by_setting = {setting: value for (_, setting), value in got.items()}
    assert by_setting["faults/aborts/ws2"][0] == "crash" and "SIGABRT" in by_setting["faults/aborts/ws2"][1]
    assert by_setting["faults/raises/ws2"][0] == "error"
    assert by_setting["faults/hangs/ws2"][0] == "timeout"
    assert killed[0] is not None, "no gang host process was found to kill"
    assert report.cases_rerun == 1, report.executor_note  # the killed host's case; the crash, error, timeout: none
    assert not ray.is_initialized()  # the driver let go of the Ray instance it started


@pytest.mark.ray
def test_an_address_nothing_listens_at_is_one_line_of_error(fresh_run: Path) -> None:
    with pytest.raises(UserError, match=r"--address 127\.0\.0\.1:1: nothing answers there"):
        run_sweep(fresh_run, SweepOptions(settings="ddp/*/ws2", executor=ExecutorConfig("ray", "127.0.0.1:1")))


# -- a simulated multi-node cluster -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the driver's node runs no gang
    for _ in range(2):
        made.add_node(num_cpus=4)
    made.wait_for_nodes()
    yield made
    if ray.is_initialized():
        ray.shutdown()
    made.shutdown()


@pytest.fixture(scope="module")
def local_result(generated_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = _copy_unswept(generated_run, tmp_path_factory.mktemp("local") / "run")
    run_sweep(run_dir, SweepOptions(settings=SELECTION))
    return results_digest(run_dir)


def _worker_nodes(cluster) -> list:
    return list(cluster.worker_nodes)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_killing_a_worker_node_mid_sweep_reruns_its_cases_and_loses_or_doubles_none(
        cluster, local_result: dict, fresh_run: Path) -> None:
    seen: Counter = Counter()
    killed: deque = deque()

    def on_result(case, record) -> None:
        seen[(record.model, record.setting)] += 1
        if sum(seen.values()) == 12 and not killed:  # gangs are mid-case on both nodes by now
            victim = _worker_nodes(cluster)[0]
            killed.append(victim)
            threading.Thread(target=cluster.remove_node, args=(victim, False), daemon=True).start()

    report = run_sweep(fresh_run, SweepOptions(settings=SELECTION, executor=ExecutorConfig("ray", cluster.address)),
                       on_result=on_result)
    assert killed, "the sweep ended before a node could be killed"
    print(f"node killed after 12 of {len(local_result)} cases: {report.executor_note}")  # pytest -s shows it
    assert report.cases_rerun >= 1, report.executor_note  # the killed node was running cases
    assert set(seen.values()) == {1} and len(seen) == len(local_result)  # each case reported once
    assert results_digest(fresh_run) == local_result
    cluster.add_node(num_cpus=4)  # the next test gets two worker nodes again
    cluster.wait_for_nodes()


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_sigkill_of_the_driver_then_the_same_command_resumes(cluster, local_result: dict, fresh_run: Path) -> None:
    command = [sys.executable, "-m", "difftest.cli", "sweep", str(fresh_run), "--settings", SELECTION,
               "--executor", "ray", "--address", cluster.address, "--minimise-budget", "0"]
    sigkill_sweep_after(command, fresh_run, 10)
    before = committed_cases(fresh_run)
    assert 10 <= len(before) < len(local_result)
    print(f"driver killed with {len(before)} of {len(local_result)} cases committed")  # pytest -s shows it

    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
    after = committed_cases(fresh_run)
    assert {key: after[key] for key in before} == before  # what was committed is not run again
    assert results_digest(fresh_run) == local_result


@pytest.mark.slow
@pytest.mark.cluster
def test_a_gang_no_node_can_hold_is_unsupported_with_the_reason(cluster, fresh_run: Path) -> None:
    report = run_sweep(fresh_run, SweepOptions(settings="fsdp2/*/ws4", models="*-i0",
                                               executor=ExecutorConfig("ray", cluster.address, cpus_per_rank=2)))
    from difftest.contracts.registry import get_setting

    records = {r.setting: r for r in Store(fresh_run).records()}
    refused = [r for name, r in records.items() if get_setting(name).world_size == 4]
    assert refused and {r.status for r in refused} == {"unsupported"}
    assert "no node with 8 CPUs for a 4-rank gang" in refused[0].message
    assert records["reference"].status == "ok"  # one rank, two CPUs: it fits
    assert report.statuses["unsupported"] == len(refused)
    assert {r.status for r in records.values() if r not in refused} == {"ok"}
