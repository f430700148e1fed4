"""Errors that tell the user what to fix; each names the file, the record and the field."""

from __future__ import annotations


class EyrieError(Exception):
    """Base class: a problem the user can act on (bad config, bad input, broken contract)."""


class ConfigError(EyrieError):
    pass


class BadRecordError(EyrieError):
    """One input record cannot be used. Raised, or counted when the dataset says on_bad_record: skip."""

    def __init__(self, file: str, location: str, problem: str, record_id: str | None = None, field: str | None = None):
        self.file, self.location, self.problem = file, location, problem
        self.record_id, self.field = record_id, field
        parts = [f"{file}: {location}"]
        if record_id is not None:
            parts.append(f"record id {record_id!r}")
        if field is not None:
            parts.append(f"field {field!r}")
        super().__init__(
            ", ".join(parts) + f": {problem}. Fix the record, or set on_bad_record: skip for this dataset to count and skip it."
        )


class InputFileError(EyrieError):
    """The whole input file is unusable (missing, empty, unreadable format)."""


class ArtifactError(InputFileError):
    """An artifact eyrie wrote cannot be read, carries broken eyrie metadata, or no longer matches its content digest."""


class ContractError(EyrieError):
    """Two stages disagree (template, target, layer ids, shapes): continuing would waste the work downstream."""
