"""Errors a user can act on. The CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input or usage: the message says which file/option, what is wrong, and what to do."""


class Unsupported(Exception):
    """Raised by a setting when the library refuses the combination; recorded as `unsupported`."""


class InvariantViolated(Exception):
    """Raised by a setting whose run broke a promise it checks itself (a stashed weight version, a preserved
    mean, an unchanged set of parameter names); recorded as `inconsistent` with the message."""


class ConversionFailed(RuntimeError):
    """A model has no form in the framework a setting needs (its export or conversion failed); says why.

    Settings that test the conversion record it as an `error`; settings that only need the model record it
    as `unsupported`.
    """
