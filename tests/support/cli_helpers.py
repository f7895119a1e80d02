"""Helpers of the CLI tests: `one_line_error`, a CLI result that failed with exit code 2 and one
`shardkit: error:` line holding the given phrases (tests/unit/cli, tests/unit/checkpoint,
tests/system/newcomer)."""

from __future__ import annotations


def one_line_error(result, *phrases: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]
