"""The trainer's user-facing errors: ShardkitError subclasses, so one convention holds for the
whole project (the message says what is wrong and what to do; printed as one line; exit 2).

Exit codes: 2 for bad input (any ShardkitError), 1 for an unexpected failure. In a job of several
processes the ranks agree on a failure first (`parallel.agree`): every rank then raises `JobFailed`
carrying the first failing rank's message and exit code, and every rank exits with that code.
"""

from __future__ import annotations

from shardkit.errors import ShardkitError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


class TrainerError(ShardkitError):
    """Bad training input: options, world size, data, checkpoints."""


class DataError(TrainerError):
    """The token file is missing, malformed or does not fit the model."""


class JobFailed(TrainerError):
    """A rank of the job failed; raised on EVERY rank together, once they agreed on it. `code` is
    the exit code every rank exits with, `rank` the first rank that failed."""

    def __init__(self, message: str, rank: int, code: int, world: int):
        where = f" (rank {rank} of {world})" if rank else ""
        super().__init__(message + where)
        self.rank, self.code, self.internal = rank, code, code != EXIT_BAD_INPUT


def exit_code(error: BaseException) -> int:
    """The process exit code for `error`: the agreed code, 2 for bad input, 1 otherwise."""
    if isinstance(error, JobFailed):
        return error.code
    return EXIT_BAD_INPUT if isinstance(error, ShardkitError) else EXIT_INTERNAL


def one_line(error: BaseException) -> str:
    """`error` as one line: its message for bad input, `Type: first line` for anything else; a
    local mirror of object storage in it named by its s3:// URL."""
    from shardkit.io.store import named

    text = named(error).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(error, ShardkitError):
        return first or type(error).__name__
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


_decided: list[int] = []


def decide_exit(code: int) -> None:
    """Record that this process is going to exit with `code` (a SIGTERM from torchrun, sent when a
    peer exited first, then exits with it too: see __main__)."""
    _decided[:] = [code]


def decided_exit() -> int | None:
    return _decided[0] if _decided else None
