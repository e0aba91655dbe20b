"""What a case came to: the one list of statuses every part of the engine reads."""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    """A case's status (`difftest.storage.store`) or verdict (`difftest.judging.analysis`). A StrEnum: it is stored, written to CSV
    and compared as its plain value."""

    OK = "ok"
    INCONSISTENT = "inconsistent"  # its outputs differ from its reference's beyond the oracle, or an invariant broke
    NONDETERMINISTIC = "nondeterministic"  # a rerun differs from the first run, bit for bit
    ERROR = "error"  # it raised
    CRASH = "crash"  # a rank died (a signal, an exit)
    TIMEOUT = "timeout"  # a rank did not answer within the case's timeout
    UNSUPPORTED = "unsupported"  # it cannot run here or on this model, with the reason


STATUSES = tuple(Status)
# the verdict of a case an analysis cannot judge yet (its reference or a calibration run has still to run): a verdict of
# a running sweep's snapshot, never a case's status
PENDING = "pending"
FAILURES = (Status.ERROR, Status.CRASH, Status.TIMEOUT)  # it did not finish
DISAGREEMENTS = (Status.INCONSISTENT, Status.NONDETERMINISTIC)  # it finished with other numbers
NOT_OK = DISAGREEMENTS + FAILURES  # what a finding is made of
# by consequence, the worst first: a run that dies, hangs or raises stops a user's training outright; a silent difference
# is then ranked by its size (`difftest.findings.triage.consequence`)
CONSEQUENCE = (Status.CRASH, Status.TIMEOUT, Status.ERROR, Status.INCONSISTENT, Status.NONDETERMINISTIC)
