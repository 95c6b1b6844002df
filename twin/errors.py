"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class ServetwinError(Exception):
    """Bad input or an infeasible configuration, explained in the message."""


class ConfigError(ServetwinError):
    """An unknown or invalid flag, value, model or GPU; the message lists what is allowed."""


class TraceError(ServetwinError):
    """A malformed trace row: the message names the file, line and field."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")
        self.path, self.line, self.field = path, line, field


class InfeasibleError(ServetwinError):
    """A configuration that cannot run (a model that does not fit), with the numbers."""
