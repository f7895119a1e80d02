"""The root `shardkit` group: global options, one-line errors, and the commands added to it.

Errors in the user's input (ShardkitError) print one line `shardkit: error: ...` and exit with
code 2; nothing is left half-written. Anything unexpected prints one line and exits 1.
`--debug` shows tracebacks. Command modules never import this one: it adds their commands.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ..errors import ShardkitError
from ..io.oserror import disk_error, shown
from ..version import __version__
from . import ckpt, convert, hub, inspect, plan
from .options import common_options, configure_logging, settings


class ShardkitGroup(click.Group):
    """Turns library errors into one line on stderr and exit code 2 (tracebacks with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardkitError as e:
            if settings(ctx)["debug"]:
                raise
            click.echo(f"shardkit: error: {shown(e, 2000)}", err=True)
            ctx.exit(2)
        except BrokenPipeError:  # `shardkit ... | head`: the reader left; say nothing more
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's own flush at exit stays quiet
            ctx.exit(141)
        except OSError as e:  # the file system refused something no command foresaw: still one line
            if settings(ctx)["debug"]:
                raise
            click.echo(f"shardkit: error: {shown(disk_error(e, 'access'), 2000)}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("shardkit: interrupted; nothing was left behind", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:  # an unexpected failure: still one line unless --debug
            if settings(ctx)["debug"]:
                raise
            first = shown(str(e).splitlines()[0], 500) if str(e) else ""
            click.echo(
                f"shardkit: internal error: {type(e).__name__}: {first} (rerun with --debug for details)", err=True
            )
            ctx.exit(1)


@click.group(cls=ShardkitGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="shardkit")
@common_options
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Move LLM weights between Hugging Face checkpoints and tensor/pipeline-parallel shards.

    \b
    Shards follow neuronx-distributed's conventions (model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt).
    Typical round trip:
      shardkit convert ./Llama-2-7b-hf ./llama-tp8pp2 --to-sharded --tp 8 --pp 2 --qkv gqa
      shardkit merge ./llama-tp8pp2 ./llama-merged
      shardkit verify ./Llama-2-7b-hf ./llama-merged
    -q, -v, --debug and --progress/--no-progress may also follow the subcommand.
    Every path argument may be s3://bucket/prefix (boto3: pip install 'shardkit[s3]'; credentials
    and AWS_ENDPOINT_URL from the AWS environment); other URL schemes are refused.
    """
    settings(ctx)
    configure_logging(ctx)


for _module in (convert, inspect, plan, hub, ckpt):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    cli(prog_name="shardkit")


if __name__ == "__main__":
    main()
