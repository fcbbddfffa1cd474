"""Errors a user can act on. The CLI prints their message as one red line."""


class LLMOptError(Exception):
    """Base class: the message says what went wrong and what to do."""

    exit_code = 1


class UserInputError(LLMOptError):
    """Bad input: a missing file, an unknown option value, an unsupported model."""

    exit_code = 2


class ModelLoadError(UserInputError):
    """A checkpoint that cannot be found or is not supported."""


class DataError(UserInputError):
    """A dataset that cannot be read."""


class DoesNotFitError(LLMOptError):
    """A requested configuration does not fit in memory (used by CI gates)."""

    exit_code = 3


class EngineDeadError(LLMOptError):
    """A step failed in a way no single request explains: the engine serves nothing more."""
