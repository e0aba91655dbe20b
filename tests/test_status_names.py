"""The engine names a case's status by `difftest.contracts.status.Status` (and a running sweep's unjudged verdict by `PENDING`),
never by its bare string: a typo in a string compares unequal silently, a misspelt member fails at import."""

from __future__ import annotations

import ast
from pathlib import Path

from difftest.contracts.status import PENDING, STATUSES

ENGINE = Path(__file__).resolve().parents[1] / "difftest"
# strings that spell a status but mean something else: SQLite's integrity check answers "ok"; bisect's own outcomes
ELSEWHERE = {("integrity.py", "ok"), ("bisect.py", "ok"), ("bisect.py", "unsupported")}


def test_the_engine_names_statuses_by_their_members() -> None:
    spelled = {str(s) for s in STATUSES} | {PENDING}
    bare = []
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name == "status.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in spelled and (path.name, node.value) not in ELSEWHERE:
                bare.append(f"{path.relative_to(ENGINE)}:{node.lineno} {node.value!r}")
    assert not bare, bare
