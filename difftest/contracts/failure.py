"""How a case failed, as the store keeps it: one line in its `message` column, written and read back only here.

A raise is `<Type>: <message> || <frame> | <code> | …` (the traceback's last lines joined on one line); a rank that
died, or a group that could not start, is `<what happened>; log: <the last lines of its log>`. `head` is what a person
reads first and what a failure's signature is made of; `frames` and `log` are the evidence behind it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

_FRAMES = " || "
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
        """A raise: its type and text, and the last three lines of its traceback."""
        frames = "".join(traceback.format_exception(exc)[-3:]).strip().replace("\n", " | ")
        return cls(f"{type(exc).__name__}: {exc}", frames=frames)

    @classmethod
    def parse(cls, text: str) -> Failure:
        """A stored line read back (any message: one that is no failure is all head)."""
        head, _, frames = str(text).partition(_FRAMES)
        head, _, log = head.partition(_LOG)
        return cls(head, frames, log[1:] if log.startswith(" ") else log)

    def readable(self) -> str:
        """The line as a person reads it: the traceback's lines one per line again."""
        text = self.head + (f"{_LOG} {self.log}" if self.log else "")
        return text + ("\n\nTraceback, innermost frames last:\n" + "\n".join(self.frames.split(" | "))
                       if self.frames else "")
