"""Errors a user can fix: the CLI prints their one-line message and exits with code 2."""


class UserError(ValueError):
    """Bad input: the message names the file, field or table, and what to do."""


class DataError(UserError):
    """Unreadable, truncated or malformed data files."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""
