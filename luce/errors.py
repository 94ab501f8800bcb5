"""Errors luce raises on purpose: each carries a one-line message fit for a user."""


class LuceError(Exception):
    """Base of every error luce reports to a user without a traceback."""


class ModelFileError(LuceError):
    """A model file is missing, corrupt, truncated or unsupported."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnknownArchitectureError(ModelFileError):
    """No registered model family handles the file's architecture."""
