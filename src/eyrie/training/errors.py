"""What drafter training raises: every error names what to fix (the file, the setting or the launch)."""

from __future__ import annotations

from eyrie.core.errors import EyrieError


class TrainingError(EyrieError):
    """Drafter training cannot start or go on."""


class TrainingInputError(TrainingError):
    """The inputs (cache, vocabulary, target, settings) do not fit together; nothing was trained."""


class NonFiniteError(TrainingError):
    """A step's loss or gradient is NaN or infinite: the run stops there, before any weights are written."""
