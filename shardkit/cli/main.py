"""The root `shardkit` group: global options, one-line errors, and the commands added to it.

Errors in the user's input (ShardkitError) print one line `shardkit: error: ...` and exit with
code 2; nothing is left half-written. So do click's usage errors (a typo'd option or command, a
value out of range, a missing argument): its message and its "Try '... --help'" hint, on one line.
Anything unexpected prints one line and exits 1. `--debug` shows tracebacks. Command modules never import this one: it adds their commands.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ..errors import ShardkitError
from ..io.safety.oserror import disk_error, shown
from ..version import __version__
from . import ckpt, convert, hub, inspect, plan
from .options import common_options, configure_logging, settings


class OneLineUsageError(click.UsageError):
    """A click usage error shown as one line: `shardkit: error: <click's message> Try '<command>
    --help' for help.` (click's own `show` prints the usage, the hint and the message on 3-4)."""

    def __init__(self, error: click.UsageError):
        super().__init__(error.format_message(), error.ctx)

    def show(self, file: Any = None) -> None:
        message = " ".join(self.format_message().split())
        hint = f" Try '{self.ctx.command_path} --help' for help." if self.ctx is not None else ""
        click.echo(f"shardkit: error: {message}{hint}", file=file, err=file is None)


def one_line_usage(error: click.UsageError) -> click.UsageError:
    """`error` as a OneLineUsageError; no arguments' help (click's NoArgsIsHelpError) stays the help."""
    if isinstance(error, (OneLineUsageError, click.exceptions.NoArgsIsHelpError)):
        return error
    return OneLineUsageError(error)


class ShardkitGroup(click.Group):
    """Turns library errors into one line on stderr and exit code 2 (tracebacks with --debug), and
    click's usage errors, of this group's options and of every subcommand's, into one line too."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as e:  # the root's own options (`shardkit --bogus ...`)
            raise one_line_usage(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a subcommand's name, options or arguments
            raise one_line_usage(e) from None
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
