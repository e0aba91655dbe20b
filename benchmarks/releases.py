"""The default tier on every supported torch release: what it costs to install, what runs, what is `unsupported` and
why, and which findings a release has that the newest has not.

    python -m benchmarks.releases --out /tmp/releases [--torch 2.6.0..2.14.1] [--cache DIR] [--models-of ...]

The models are generated once (by this python) and copied into one run folder per release, so every release judges
the same bytes (`difftest diff` checks that). Each release runs in its own cached environment
(`difftest.releases.environments.environment`: torch with the fbgemm-gpu and torchrec built for it, difftest from this checkout,
without the [tf] extra), so the default models are the torch-native kinds. The sweep and the analysis run there
through the CLI, exactly as a user of that release runs them; minimisation is off (`--minimise-budget 0`).
Writes <out>/releases.md (the table) and <out>/releases.json, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from difftest.releases.diff import diff_runs
from difftest.releases.environments import (
    EnvironmentUnavailable,
    Release,
    default_cache,
    environment,
    installed,
    release_range,
    supported,
)

# the default job's torch-native kinds (the Keras kinds need TensorFlow and the converters: the [tf] extra)
TORCH_NATIVE = "dlrm=2,torchrec-dlrm=1,torchrec-deepfm=1,transformer=1,sequential=0,keras-dag=0,keras-transformer=0"


def _cli(python: Path, *args: str, timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "difftest.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _case_counts(run: Path) -> dict[str, int]:
    rows = pd.read_csv(run / "comparisons.csv", dtype=str, keep_default_na=False,
                       usecols=["model", "setting", "status"])
    worst = rows.assign(bad=rows["status"] != "ok").sort_values("bad", ascending=False, kind="stable")
    cases = worst.drop_duplicates(["model", "setting"])
    return {str(k): int(v) for k, v in cases["status"].value_counts().items()}


def _unsupported_reasons(run: Path, newest: Path | None) -> dict[str, str]:
    """Setting → reason, for settings unsupported on every model here but not on the newest release (a setting
    for another kind of model is unsupported on every release alike and says nothing about this one)."""
    def reasons(folder: Path) -> dict[str, str]:
        rows = pd.read_csv(folder / "comparisons.csv", dtype=str, keep_default_na=False,
                           usecols=["model", "setting", "status", "message"])
        by_setting = rows.groupby("setting")
        return {name: group["message"].iloc[0] for name, group in by_setting
                if (group["status"] == "unsupported").all()}
    here = reasons(run)
    there = reasons(newest) if newest is not None else {}
    return {name: reason for name, reason in sorted(here.items()) if name not in there}


def measure(python: Path, source: Path, run: Path, timeout_s: float, resume: bool = False,
            models_filter: str = "", sweep: bool = True) -> dict[str, Any]:
    """Sweep and analyse the models on one release; `resume`: keep what the run folder has (the sweep runs only the
    cases it lacks: after `--resweep` removed some, or a run that was cut off)."""
    if not (resume and (run / "run.json").is_file()):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(source, run)
    started = time.perf_counter()
    swept = _cli(python, "sweep", str(run), "--timeout", f"{timeout_s:g}",
                 *(("--models-filter", models_filter) if models_filter else ())) if sweep else \
        subprocess.CompletedProcess([], 0, "", "")
    sweep_s = time.perf_counter() - started
    analysed = _cli(python, "analyze", str(run), "--minimise-budget", "0")
    result: dict[str, Any] = {"sweep_s": round(sweep_s, 1), "sweep_rc": swept.returncode,
                              "analyze_rc": analysed.returncode}
    if swept.returncode or analysed.returncode:
        result["error"] = (swept.stderr or analysed.stderr).strip().splitlines()[-1:]
        return result
    return {**result, **summarise(run)}


def summarise(run: Path) -> dict[str, Any]:
    """Case counts, the number of findings, and each finding by the known issue that explains it (else its title)."""
    findings = pd.read_csv(run / "findings.csv", dtype=str, keep_default_na=False)
    return {"cases": _case_counts(run), "findings": len(findings),
            "by_cause": sorted(f"{r['known_issue'] or 'new: ' + r['title']}" for _, r in findings.iterrows())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    releases = supported()
    parser.add_argument("--torch", default=f"{releases[0].torch}..{releases[-1].torch}")
    parser.add_argument("--cache", type=Path, default=None, help="environments (default: $DIFFTEST_STACKS or "
                        f"{default_cache()})")
    parser.add_argument("--models-of", default=TORCH_NATIVE)
    # a case's limit: the slowest clean case of these models takes ~20 s here, and a release's hang costs this much
    parser.add_argument("--timeout", type=float, default=45.0)
    parser.add_argument("--models-filter", default="", help="sweep only these models (comma-separated globs): a "
                        "release whose hangs cost a timeout each, on fewer models")
    parser.add_argument("--analyse-only", action="store_true", help="sweep nothing: judge and triage each "
                        "release's run folder again (a newer manifest, a newer triage) and write the table")
    parser.add_argument("--resweep", default="", help="keep each release's run folder and sweep again only the "
                        "cases of settings matching this SQL LIKE pattern (e.g. 'torchrec/ebc/mixed%%'), then analyse")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    source = out / "models"
    if not (source / "run.json").is_file():
        made = _cli(Path(sys.executable), "generate", "--out", str(source), "--models-of", args.models_of)
        if made.returncode:
            sys.exit(f"benchmarks.releases: generating the models failed: {made.stderr.strip()[-500:]}")
    wanted = release_range(args.torch)
    previous = out / "releases.json"
    results: dict[str, dict[str, Any]] = json.loads(previous.read_text()) if previous.is_file() else {}
    # the newest first: every other release is compared with it
    for rel in sorted(wanted, key=lambda r: r.minor, reverse=True):
        started = time.perf_counter()
        cached = installed(rel) or (Path(args.cache or default_cache()) / f"torch-{rel.torch}-cpu").is_dir()
        try:
            python = Path(sys.executable) if installed(rel) else environment(rel, args.cache, log=print)
        except EnvironmentUnavailable as exc:
            results[rel.torch] = {"install": f"not installable: {exc}"}
            continue
        install_s = time.perf_counter() - started
        print(f"torch {rel.torch}: environment {'cached' if cached else f'made in {install_s:.0f} s'}", flush=True)
        run = out / f"torch-{rel.torch}"
        if args.resweep and (run / "store.sqlite").is_file():
            with sqlite3.connect(run / "store.sqlite") as store:
                store.execute("DELETE FROM cases WHERE setting LIKE ?", (args.resweep,))
        row = measure(python, source, run, args.timeout, resume=bool(args.resweep) or args.analyse_only,
                      models_filter=args.models_filter, sweep=not args.analyse_only)
        if (args.resweep or args.analyse_only) and rel.torch in results:  # the first sweep's time and install stand
            row.update({k: results[rel.torch][k] for k in ("sweep_s", "install") if k in results[rel.torch]})
        else:
            row["install"] = "cached" if cached else f"{install_s:.0f} s"
        results[rel.torch] = row
        print(f"torch {rel.torch}: {json.dumps(row)}", flush=True)
    newest = max(wanted, key=lambda r: r.minor)
    newest_run = out / f"torch-{newest.torch}"
    for rel in wanted:
        row, run = results[rel.torch], out / f"torch-{rel.torch}"
        if "cases" not in row:
            continue
        row["unsupported_here_only"] = _unsupported_reasons(run, newest_run if rel != newest else None)
        if rel != newest and "cases" in results[newest.torch]:
            diff = diff_runs(run, newest_run)
            row["findings_not_on_newest"] = [f"{r['id']} {r['title']} ({r['cases']} cases)"
                                             for _, r in diff.only_a.iterrows()]
            row["findings_only_on_newest"] = [f"{r['id']} {r['title']}" for _, r in diff.only_b.iterrows()]
            row["verdicts_changed"] = [f"{c.model} × {c.setting}: {c.before} -> {c.after}" for c in diff.changed]
    (out / "releases.json").write_text(json.dumps(results, indent=1))
    write_table(out, wanted, results)


def write_table(out: Path, wanted: list[Release], results: dict[str, dict[str, Any]]) -> None:
    newest = max(wanted, key=lambda r: r.minor)
    lines = ["| torch | install | sweep s | ok | inconsistent | error | crash | timeout | unsupported | findings |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rel in wanted:
        row = results[rel.torch]
        counts = row.get("cases", {})
        lines.append(f"| {rel.torch} | {row.get('install')} | {row.get('sweep_s', '-')} | "
                     + " | ".join(str(counts.get(s, 0)) for s in
                                  ("ok", "inconsistent", "error", "crash", "timeout", "unsupported"))
                     + f" | {row.get('findings', row.get('error', '-'))} |")
    for rel in wanted:
        row = results[rel.torch]
        extra = [f"- unsupported here only: `{name}`: {reason}" for name, reason in
                 row.get("unsupported_here_only", {}).items()]
        extra += [f"- finding not on {newest.torch}: {text}" for text in row.get("findings_not_on_newest", [])]
        extra += [f"- finding only on {newest.torch}: {text}" for text in row.get("findings_only_on_newest", [])]
        extra += [f"- verdict changed towards {newest.torch}: {text}" for text in row.get("verdicts_changed", [])]
        if extra:
            lines += ["", f"torch {rel.torch}:", *extra]
    causes = sorted({c for row in results.values() for c in row.get("by_cause", [])})
    if causes:  # since which release: each cause × release
        lines += ["", "| cause | " + " | ".join(r.torch for r in wanted) + " |",
                  "|---|" + "---|" * len(wanted)]
        lines += [f"| {cause[:110]} | " + " | ".join(
            ("x" if cause in results[r.torch].get("by_cause", []) else "·") if "cases" in results[r.torch] else "-"
            for r in wanted) + " |" for cause in causes]
    (out / "releases.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
