"""Errors that mean "bad input": the CLI prints their one-line message and exits with code 2."""


class UserError(ValueError):
    """Bad user input. The message is one line naming the problem and the allowed values."""


class UnknownNameError(UserError, LookupError):
    """A name (model, emitter, schedule, predictor, ...) that no plugin registered."""


class TraceError(UserError):
    """A malformed trace file (truncated record, dangling dependency, cycle, ...)."""
