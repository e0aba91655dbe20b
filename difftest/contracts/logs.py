"""What a process's log says about how it ended, for the message of a case it failed."""

from __future__ import annotations

from pathlib import Path

# lines every rank writes whatever happens: quoting them would hide the cause
_NOISE = ("Warning", "warnings.warn", "W1", "is_fx_tracing")


def log_tail(path: Path, lines: int = 6) -> list[str]:
    """The log's last lines, warnings left out; after a fatal signal, the innermost Python frames faulthandler wrote
    instead (a segfault or an abort writes nothing else)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return []
    fatal = [i for i, line in enumerate(text) if line.startswith("Fatal Python error")]
    if fatal:
        return [line.strip() for line in text[fatal[-1]:] if line.strip().startswith(("Fatal", "File"))][:lines]
    return [line for line in text if not any(n in line for n in _NOISE)][-lines:]
