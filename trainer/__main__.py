"""`python -m trainer ...` / `torchrun --nproc-per-node N -m trainer ...`.

Exit codes: 0 done, 2 bad input (options, layout, world size, data, checkpoints, destinations),
1 an unexpected failure, 130 interrupted. Under torchrun the ranks first agree on a failure, then
rank 0 prints ONE line (`trainer: error: ...`) and EVERY rank exits with the same code; nothing is
written on bad input. `--debug` (or TRAINER_DEBUG=1) adds the traceback of each rank that failed.
(torchrun itself then exits 1 and lists every rank's exit code in its failure report.)
"""

from __future__ import annotations

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


def _report(error: Exception, rank: int, code: int, debug: bool) -> None:
    """One line on stderr (rank 0 for an error the job agreed on), plus tracebacks with --debug."""
    from .errors import JobFailed, one_line

    own = error.__cause__ if isinstance(error, JobFailed) else error
    if debug and own is not None:
        traceback.print_exception(own, file=sys.stderr)
    if isinstance(error, JobFailed):
        if rank == 0:
            kind = "internal error" if error.internal else "error"
            hint = "" if debug or not error.internal else " (--debug for the traceback)"
            print(f"trainer: {kind}: {error}{hint}", file=sys.stderr, flush=True)
        return
    if isinstance(error, ShardkitError):
        if rank != 0:
            # not agreed on (a whole-job error raised outside the trainer's agreement): rank 0 reports
            # it; a rank still alive after the grace failed alone and says so itself
            time.sleep(ERROR_GRACE_S)
            print(f"trainer: error on rank {rank}: {error}", file=sys.stderr, flush=True)
        else:
            print(f"trainer: error: {one_line(error)}", file=sys.stderr, flush=True)
        return
    where = f" on rank {rank}" if rank else ""
    print(
        f"trainer: internal error{where}: {one_line(error)}" + ("" if debug else " (--debug for the traceback)"),
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    from .config import parse_args
    from .errors import decide_exit, exit_code
    from .parallel import world_from_env

    cfg = parse_args(argv)
    rank, world, _ = world_from_env()
    debug = cfg.debug or bool(os.environ.get("TRAINER_DEBUG"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="trainer: %(message)s", stream=sys.stderr
    )
    for noisy in ("torch.distributed", "torch.distributed.pipelining", "shardkit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if world > 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
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
        _report(e, rank, code, debug)
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
