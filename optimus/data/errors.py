"""The one error type of the data subsystem."""


class DataError(ValueError):
    """A user's data mistake: the message names what is wrong and how to fix it."""
