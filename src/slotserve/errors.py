"""Typed errors a user of slotserve can meet.

Each carries the numbers or names that explain it, so a message can say what was wrong,
what the limit was and how to fix it.
"""

from __future__ import annotations


class SlotserveError(Exception):
    """Base class of every error slotserve raises on purpose."""


class ArtifactError(SlotserveError):
    """A model file is missing, corrupt, truncated or of an unsupported kind.

    ``path`` names the file, ``field`` the metadata key or tensor that was wrong.
    """

    def __init__(self, path: object, message: str, field: str | None = None) -> None:
        self.path = str(path)
        self.field = field
        where = f"{self.path}" + (f" [{field}]" if field else "")
        super().__init__(f"{where}: {message}")


class SchemaVersionError(ArtifactError):
    """A bundle's schema version is one this runtime does not read (``found`` is the bundle's,
    ``readable`` the versions this runtime reads)."""

    def __init__(self, path: object, found: int, readable: tuple[int, ...], fix: str) -> None:
        self.found, self.readable = found, readable
        super().__init__(
            path,
            f"bundle schema {found}, but this runtime reads schema "
            f"{', '.join(map(str, readable))}; {fix}",
            "schema",
        )


class FormatVersionError(SchemaVersionError):
    """A bundle's ExecuTorch file is of a format this runtime does not read: ``identifier``
    is the file's flatbuffer identifier (``ET12`` for a program, ``FT01`` for named data),
    ``identifiers`` the ones this runtime reads, and ``found`` and ``readable`` their version
    numbers (the identifier's last two characters, or -1 where they are not digits)."""

    def __init__(
        self,
        path: object,
        what: str,
        identifier: str,
        identifiers: tuple[str, ...],
        runtime: str,
        fix: str,
    ) -> None:
        self.identifier, self.identifiers = identifier, identifiers
        self.found = _format_number(identifier)
        self.readable = tuple(_format_number(known) for known in identifiers)
        ArtifactError.__init__(
            self,
            path,
            f"{what} format {identifier}, but this runtime (executorch {runtime}) reads "
            f"{', '.join(identifiers)}; {fix}",
            "format",
        )


def _format_number(identifier: str) -> int:
    digits = identifier[2:]
    return int(digits) if digits.isascii() and digits.isdigit() else -1


class ContextOverflow(SlotserveError):
    """A sequence would grow past the context it was given."""

    def __init__(self, needed: int, limit: int, hint: str = "") -> None:
        self.needed = needed
        self.limit = limit
        msg = f"needs {needed} positions but the context holds {limit}"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class PlanError(SlotserveError):
    """A capacity plan does not fit its memory budget."""


class KVExhausted(SlotserveError):
    """The KV pool cannot hold what was asked (no free slot, or too few free blocks).

    Raised before anything changes: a reservation is all or nothing.
    """

    def __init__(self, what: str, needed: int, available: int, hint: str = "") -> None:
        self.what, self.needed, self.available = what, needed, available
        msg = f"KV pool: needs {needed} {what} but {available} are free"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class SessionError(SlotserveError, ValueError):
    """A KV operation named a session that does not exist, already exists, or asked for
    something its state cannot give (clone past the committed length, say)."""


class DraftModelMismatch(SlotserveError, ValueError):
    """A draft model (speculative decoding) that cannot draft for its target: its
    vocabulary has ``draft_vocab`` entries where the target's has ``target_vocab`` (a
    drafted token id must name the target's token), or its context is shorter than the
    engine's (``what`` says which, with both numbers)."""

    def __init__(self, draft: str, target: str, what: str, draft_value: int, target_value: int):
        self.draft, self.target, self.what = draft, target, what
        self.draft_value, self.target_value = draft_value, target_value
        super().__init__(
            f"draft model {draft} has {what} {draft_value}, the target {target} {target_value}: "
            "a draft model must share the target's tokenizer and vocabulary (the same model "
            "in another weight format, or a smaller one of its family) and hold the engine's "
            "context; pass another --draft-model, or --speculate ngram"
        )


class ThreadPoolConflict(SlotserveError, ValueError):
    """ExecuTorch's thread pool is one per process: the bundle at ``path`` asks for
    ``requested`` threads while ``holder``, a bundle still loaded, runs it at ``held``."""

    def __init__(self, path: object, requested: int, held: int, holder: str) -> None:
        self.path, self.requested, self.held, self.holder = str(path), requested, held, holder
        super().__init__(
            f"{path}: asks ExecuTorch's thread pool for {requested} threads, but {holder}, "
            f"still loaded in this process, runs it at {held}; the pool is one per process: "
            f"load every bundle with threads={held} (serve --threads {held}) or 0, or serve "
            "this one in another process"
        )


REFUSAL_REASONS = (
    "slots_full",
    "kv_exhausted",
    "context_too_long",
    "queue_full",
    "queue_timeout",
    "pressure",
    "closed",
    "model_capacity",  # an on-demand model whose load has no room in the memory plan
    "batch_too_large",  # an encoder request of more texts than its engine admits at once
)


class AdmissionRefused(SlotserveError):
    """The engine will not run a request; ``reason`` is one of `REFUSAL_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REFUSAL_REASONS, reason
        self.reason = reason
        super().__init__(f"{reason}: {message}")
