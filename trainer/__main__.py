"""`python -m trainer ...` / `torchrun --nproc-per-node N -m trainer ...`.

Bad input (options, layout, world size, data, checkpoints) prints ONE line on rank 0 and every
rank exits with code 2; nothing is written. (The other ranks wait a few seconds before exiting so
that rank 0 reports first; one that outlives rank 0 failed alone and reports its own error.) An unexpected failure prints one line on the rank
where it happened (set TRAINER_DEBUG=1 for the traceback) and exits 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from shardkit.errors import ShardkitError

ERROR_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    from .config import parse_args
    from .parallel import world_from_env

    cfg = parse_args(argv)
    rank = world_from_env()[0]
    debug = bool(os.environ.get("TRAINER_DEBUG"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="trainer: %(message)s",
                        stream=sys.stderr)
    for noisy in ("torch.distributed", "torch.distributed.pipelining", "shardkit"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from .loop import train

        summary = train(cfg)
    except ShardkitError as e:
        if debug:
            raise
        if rank == 0:
            print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank usually meets the same bad input at once. Give rank 0 the time to report it
            # (torchrun stops the other workers when it exits); a rank still alive afterwards failed
            # alone, and says so itself.
            time.sleep(ERROR_GRACE_S)
            print(f"trainer: error on rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        if rank == 0:
            print("trainer: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a wall of tracebacks from every rank
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"trainer: internal error on rank {rank}: {type(e).__name__}: {first} "
              "(set TRAINER_DEBUG=1 for the traceback)", file=sys.stderr, flush=True)
        return 1
    if rank == 0 and summary.steps:
        last = summary.losses[-1]
        print(f"trainer: steps {summary.first_step + 1}-{summary.first_step + summary.steps} ({summary.layout}): "
              f"final loss {last:.4f}, {summary.tokens_per_s:,.0f} tokens/s"
              + (f"; exported {summary.exported}" if summary.exported else ""), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
