"""How a campaign's throughput grows with the cores it may use: the same campaign, pinned to N cores, for M minutes.

    python -m benchmarks.campaign_cores [--cores 2,16] [--minutes 3] [--out DIR] [-- CAMPAIGN OPTIONS]

Each core count runs `difftest campaign` in a fresh folder (the same seeds and options: the same rounds, as far as each
gets), its process and every rank it starts pinned to the first N cores the machine gives this process (the
scheduler sizes its worker groups by that affinity). Per count the table gives rounds, cases, the rounds' wall
time, cases per minute of the rounds and of the call's wall time, distinct causes and the folder's size on disk;
`--out` keeps every campaign's log, its `--report` and a JSON of the rows. Options after `--` go to `difftest
campaign` (e.g. `--kind transformer`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def summarise(folder: Path) -> dict[str, float]:
    """Rounds done, their cases and seconds, and the distinct causes, from the campaign's own files."""
    from difftest.campaign.page import round_points

    points = round_points(folder)
    if not points:
        return {"rounds": 0, "cases": 0, "minutes": 0.0, "cases_per_minute": 0.0, "causes": 0}
    last = points[-1]
    return {"rounds": last.number, "cases": last.cases, "minutes": last.minutes,
            "cases_per_minute": last.cases / last.minutes if last.minutes else 0.0, "causes": last.causes,
            "causes_by_minute": [(round(p.minutes, 2), p.causes) for p in points]}


def run_pinned(cores: list[int], folder: Path, minutes: float, campaign_args: list[str], log: Path) -> float:
    """`difftest campaign` pinned to `cores` for `minutes` (a round begun is finished); its wall seconds."""
    command = [sys.executable, "-m", "difftest.cli", "campaign", str(folder), "--hours", f"{minutes / 60:.5f}",
               *campaign_args]
    started = time.monotonic()
    with log.open("w") as out:
        # the affinity is inherited by every process the campaign starts: its import server and ranks
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False,
                       preexec_fn=lambda: os.sched_setaffinity(0, cores))
    return time.monotonic() - started


def main() -> None:
    argv = sys.argv[1:]
    campaign_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", default="", help="comma-separated; default 2 and every core this process may use")
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="keep logs, reports and the rows' JSON here")
    args = parser.parse_args(own)
    available = sorted(os.sched_getaffinity(0))
    counts = sorted({int(c) for c in args.cores.split(",")} if args.cores else {min(2, len(available)), len(available)})
    if counts[-1] > len(available):
        sys.exit(f"campaign_cores: --cores {counts[-1]} asked for, this process may use {len(available)} cores")
    out = args.out or Path(tempfile.mkdtemp(prefix="difftest-campaign-cores-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for count in counts:
        folder = Path(tempfile.mkdtemp(prefix=f"difftest-campaign-{count}c-"))
        wall = run_pinned(available[:count], folder, args.minutes, campaign_args, out / f"campaign_{count}c.log")
        report = subprocess.run([sys.executable, "-m", "difftest.cli", "campaign", str(folder), "--report"],
                                capture_output=True, text=True, check=False)
        (out / f"report_{count}c.txt").write_text(report.stdout + report.stderr)
        row = {"cores": count, "wall_s": round(wall, 1), "disk_mb": round(folder_size(folder) / 1e6, 1),
               **summarise(folder)}
        # the call's wall time adds the campaign's start and the round begun before the deadline
        row["cases_per_wall_minute"] = row["cases"] / (wall / 60)
        rows.append(row)
    (out / "campaign_cores.json").write_text(json.dumps(rows, indent=1))
    print(f"{'cores':>5} {'rounds':>6} {'cases':>6} {'minutes':>7} {'cases/min':>9} {'speed-up':>8} "
          f"{'per wall min':>12} {'causes':>6} {'disk MB':>7}")
    unit = rows[0]["cases_per_minute"] or 1.0
    for row in rows:
        print(f"{row['cores']:>5} {row['rounds']:>6} {row['cases']:>6} {row['minutes']:>7.2f} "
              f"{row['cases_per_minute']:>9.0f} {row['cases_per_minute'] / unit:>7.2f}x "
              f"{row['cases_per_wall_minute']:>12.0f} {row['causes']:>6} "
              f"{row['disk_mb']:>7}")
    print(f"logs and reports: {out}")


if __name__ == "__main__":
    main()
