"""What a setting notes about a case (`RunContext.notes`: the plan it drew, the graphs it compiled), kept in the store's
message column as one line `key: value; key: value` (an ok case has no other message): written and read back only
here. A key is words and spaces; a value may hold anything but `; <key>: `."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SEPARATOR = "; "
_NEXT_KEY = re.compile(r"; (?=[A-Za-z][\w ]*: )")


def render_notes(notes: Mapping[str, str]) -> str:
    return _SEPARATOR.join(f"{key}: {value}" for key, value in notes.items())


def parse_notes(text: str) -> dict[str, str]:
    """A stored line's notes (a failure's message, which has none of this form, gives what it seems to hold)."""
    notes = {}
    for item in _NEXT_KEY.split(str(text)) if text else ():
        key, found, value = item.partition(": ")
        if found:
            notes[key] = value
    return notes
