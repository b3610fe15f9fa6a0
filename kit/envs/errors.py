"""The env stage's error types (all KitErrors: the CLI prints them as one `error: ...` line, exit 2)."""

from __future__ import annotations

from kit.errors import IntegrityError, KitError


class EnvError(KitError, ValueError):
    """A bad environment name, a missing source, a target that exists, no space: says what to do next."""


class EnvArchiveError(KitError, ValueError):
    """An archive that is unsafe, corrupt, or in a format the kit cannot read."""


class ArchiveDamagedError(EnvArchiveError, IntegrityError):
    """An archive that is truncated or damaged: a member is missing, cut short or differs from its hash."""
