"""How a case failed, as the store keeps it: one line in its `message` column, written and read back only here.

A raise is `<Type>: <message> || <frame> | <code> | …` (the innermost frame outside torch and `…` where that frame
is not among the traceback's last lines, then those lines, joined on one line); a rank that
died, or a group that could not start, is `<what happened>; log: <the last lines of its log>`. `head` is what a person
reads first and what a failure's signature is made of; `frames` and `log` are the evidence behind it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

_FRAMES = " || "
_ELIDED = "…"
_LOG = "; log:"
LIMIT = 4000  # characters a stored failure keeps


@dataclass(frozen=True)
class Failure:
    head: str
    frames: str = ""  # the traceback's last lines, " | " between them
    log: str = ""  # the failing process's last log lines

    def __str__(self) -> str:
        text = self.head + (f"{_FRAMES}{self.frames}" if self.frames else "")
        return text + (f"{_LOG} {self.log}" if self.log else "")

    def stored(self) -> str:
        """What the store keeps: the line, cut to `LIMIT` characters."""
        return str(self)[:LIMIT]

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """A raise: its type and text, the last three lines of its traceback and, before them, the innermost frame
        outside torch and the standard library (`calling_frame`) where that is another frame."""
        frames = "".join(traceback.format_exception(exc)[-3:]).strip().replace("\n", " | ")
        caller = calling_frame(exc)
        if caller and caller.partition(" | ")[0] not in frames:
            frames = f"{caller} | {_ELIDED} | {frames}"
        return cls(f"{type(exc).__name__}: {exc}", frames=frames)

    @classmethod
    def parse(cls, text: str) -> Failure:
        """A stored line read back (any message: one that is no failure is all head)."""
        head, _, frames = str(text).partition(_FRAMES)
        head, _, log = head.partition(_LOG)
        return cls(head, frames, log[1:] if log.startswith(" ") else log)

    @property
    def last_frames(self) -> str:
        """The traceback's last lines alone, without the calling frame kept before them."""
        return self.frames.split(f" | {_ELIDED} | ", 1)[-1]

    def readable(self) -> str:
        """The line as a person reads it: the traceback's lines one per line again."""
        text = self.head + (f"{_LOG} {self.log}" if self.log else "")
        return text + ("\n\nTraceback, innermost frames last:\n" + "\n".join(self.frames.split(" | "))
                       if self.frames else "")


def calling_frame(exc: BaseException) -> str:
    """The innermost frame of `exc`'s traceback outside torch and the standard library, as the traceback prints it
    (`File "…", line N, in f | its code`): the model's module or the setting that called the operator which raised.
    An error deep in DTensor's or autograd's dispatch keeps only dispatcher frames in its last lines; this one says
    which layer of the model reached it. "" when every frame is torch's."""
    import sys
    import sysconfig
    from pathlib import Path

    def root(path: str) -> str:
        return str(Path(path).resolve()) + "/"

    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    torch_root = root(str(Path(torch_file).parent)) if torch_file else None
    paths = sysconfig.get_paths()
    stdlib = root(paths["stdlib"])
    # an interpreter without a virtualenv keeps its site-packages inside the standard library's folder
    libraries = (root(paths["purelib"]), root(paths["platlib"]))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<"):
            continue  # frozen imports, code compiled from a string
        path = root(frame.filename)
        in_stdlib = path.startswith(stdlib) and not path.startswith(libraries)
        if not in_stdlib and not (torch_root is not None and path.startswith(torch_root)):
            line = (frame.line or "").strip()
            return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}' + (f" | {line}" if line else "")
    return ""

