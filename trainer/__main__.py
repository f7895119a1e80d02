"""`python -m trainer ...` / `torchrun --nproc-per-node N -m trainer ...`.

Exit codes: 0 done, 2 bad input (options, layout, world size, data, checkpoints, destinations),
1 an unexpected failure, 130 interrupted. Under torchrun the ranks first agree on a failure, then
rank 0 prints ONE line (`trainer: error: ...`) and EVERY rank exits with the same code; nothing is
written on bad input. `--debug` (or TRAINER_DEBUG=1) adds the traceback of each rank that failed.
(torchrun itself then exits 1 and lists every rank's exit code in its failure report; each rank
writes the line into torchrun's error file, so the report shows it, last, instead of a link.)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

from shardkit.errors import ShardkitError

from .errors import decided_exit

ERROR_GRACE_S = 5.0


def _on_sigterm(signum, frame) -> None:
    """torchrun stops the other workers once one exits. A rank that has already decided how to
    exit (the job agreed on a failure) exits with that code; any other SIGTERM keeps its meaning."""
    code = decided_exit()
    if code is None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _exit_now(code)


def _exit_now(code: int) -> None:
    """Exit at once, without the interpreter's (slow) teardown: under torchrun a worker that is
    still tearing down when a peer has exited gets SIGTERM, and then dies of it (exit -15)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _line(error: Exception, rank: int, debug: bool) -> str:
    """The one line that reports `error` (the job's agreed failure, or this rank's own)."""
    from .errors import JobFailed, one_line

    if isinstance(error, JobFailed):
        kind = "internal error" if error.internal else "error"
        hint = "" if debug or not error.internal else " (--debug for the traceback)"
        return f"trainer: {kind}: {error}{hint}"
    if isinstance(error, ShardkitError):
        return f"trainer: error on rank {rank}: {error}" if rank else f"trainer: error: {one_line(error)}"
    where = f" on rank {rank}" if rank else ""
    return f"trainer: internal error{where}: {one_line(error)}" + ("" if debug else " (--debug for the traceback)")


def _report(error: Exception, rank: int, code: int, debug: bool) -> str:
    """One line on stderr (rank 0 for an error the job agreed on), plus tracebacks with --debug;
    returns the line."""
    from .errors import JobFailed

    own = error.__cause__ if isinstance(error, JobFailed) else error
    if debug and own is not None:
        traceback.print_exception(own, file=sys.stderr)
    line = _line(error, rank, debug)
    if isinstance(error, JobFailed):
        if rank == 0:
            print(line, file=sys.stderr, flush=True)
    elif isinstance(error, ShardkitError) and rank != 0:
        # not agreed on (a whole-job error raised outside the trainer's agreement): rank 0 reports
        # it; a rank still alive after the grace failed alone and says so itself
        time.sleep(ERROR_GRACE_S)
        print(line, file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)
    return line


def _tell_torchrun(line: str, error: BaseException, debug: bool) -> None:
    """Under torchrun, this rank's failure as torch.distributed.elastic's error file (what its
    `record` decorator writes): torchrun's failure report then shows `line` as each failed rank's
    traceback, so the report (which comes last) ends with it instead of a documentation link.
    With --debug the traceback comes first, the line still last."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    from shardkit.io.safety.durable import write_text

    from .errors import JobFailed

    own = error.__cause__ if isinstance(error, JobFailed) else error
    shown = "".join(traceback.format_exception(own)) + line if debug and own is not None else line
    data = {"message": {"message": line, "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        write_text(path, json.dumps(data), fsync=False)
    except OSError:
        pass  # torchrun then shows its own line for this rank: the failure is reported either way


def main(argv: list[str] | None = None) -> int:
    from .config import UsageError, parse_args
    from .errors import decide_exit, exit_code
    from .parallel import world_from_env

    try:
        cfg = parse_args(argv)
    except UsageError as e:  # every rank parses the same line: rank 0 says it, every rank exits 2
        line = f"trainer: error: {e}"
        if world_from_env()[0] == 0:
            print(line, file=sys.stderr, flush=True)
        _tell_torchrun(line, e, False)
        return exit_code(e)
    rank, world, _ = world_from_env()
    debug = cfg.debug or bool(os.environ.get("TRAINER_DEBUG"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="trainer: %(message)s", stream=sys.stderr
    )
    for noisy in ("torch.distributed", "torch.distributed.pipelining", "shardkit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if world > 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    from shardkit.io.store import scope

    with scope(interrupt=False):  # the run's s3:// mirrors: named by URL in its messages, removed at its end
        try:
            from .loop import train

            summary = train(cfg)
        except KeyboardInterrupt:
            if rank == 0:
                print("trainer: interrupted", file=sys.stderr, flush=True)
            return 130
        except Exception as e:  # noqa: BLE001 - one line, not a wall of tracebacks from every rank
            code = exit_code(e)
            decide_exit(code)
            _tell_torchrun(_report(e, rank, code, debug), e, debug)
            return code
    if rank == 0:
        exported = f"; exported {summary.exported}" if summary.exported else ""
        evaluated = f", eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else ""
        if summary.steps:
            print(
                f"trainer: steps {summary.first_step + 1}-{summary.first_step + summary.steps} ({summary.layout}): "
                f"final loss {summary.losses[-1]:.4f}{evaluated}, {summary.tokens_per_s:,.0f} tokens/s{exported}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"trainer: nothing to train: already at step {summary.first_step} ({summary.layout}){exported}",
                file=sys.stderr,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    exit_code = main()
    if exit_code and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit_now(exit_code)
    sys.exit(exit_code)
