"""argparse pieces shared by every ``pagedllm`` subcommand (vLLM's behaviour):

* ``FlexibleArgumentParser``: a user mistake is ONE line on stderr,
  ``<prog>: error: <what> (see '<prog> --help')``, and exit status 2 (no usage dump);
* ``human_readable_int``: ``32k`` / ``32K`` / ``1m`` / ``1M`` (vLLM's ``human_readable_int``:
  lowercase suffixes are decimal, uppercase binary);
* ``DefaultsHelpFormatter``: every flag's help line shows its default;
* ``show_filtered_help``: ``--help=listgroup``, ``--help=all``, ``--help=<group title>`` and
  ``--help=<keyword>`` (flags whose name contains it), as ``vllm serve --help=...``.
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import IO, Any, Optional

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(value: str) -> int:
    """Parse an integer with an optional size suffix, as vLLM's ``human_readable_int``.

    Lowercase suffixes are decimal (``1k`` = 1,000, ``1m`` = 10**6, ``g``, ``t``), uppercase ones
    binary (``1K`` = 1,024, ``1M`` = 2**20, ``G``, ``T``). Decimals are allowed with decimal
    suffixes only (``25.6k`` = 25,600). A plain integer is returned as is.

    Raises:
        argparse.ArgumentTypeError: not an integer, or a decimal with a binary suffix.
    """
    text = value.strip()
    m = _HUMAN_INT.fullmatch(text)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with binary suffixes like {suffix!r} in {value!r}; "
                f"did you mean {number}{suffix.lower()}?")
        return int(number) * _BINARY[suffix]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 4096, 32k (32,000) or 32K (32,768), got {value!r}") from None


def positive_int(value: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse names the flag in its one-line error).

    Raises:
        argparse.ArgumentTypeError: not an integer, or below 1.
    """
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def positive_human_int(value: str) -> int:
    """``human_readable_int`` that must be > 0 (``--max-model-len``, ``--max-num-batched-tokens``).

    Raises:
        argparse.ArgumentTypeError: not an integer, or not positive.
    """
    n = human_readable_int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def port_number(value: str) -> int:
    """A TCP port, 1-65535, for argparse.

    Raises:
        argparse.ArgumentTypeError: not an integer in that range.
    """
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {value!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (1-65535), got {port}")
    return port


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option's help that does not already say its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            sep = " " if text else ""
            return f"{text}{sep}(default: %(default)s)"
        return text


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (``<prog>: error: ... (see '<prog> --help')``,
    exit status 2) and whose help shows every default; subparsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print ``<prog>: error: <message> (see '<prog> --help')`` on one line and exit 2."""
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def fail(prog: str, message: str, status: int = 2, file: Optional[IO[str]] = None) -> int:
    """Print the one-line CLI error ``<prog>: error: <message>`` (whitespace and newlines folded)
    and return ``status`` (2: a user mistake), for errors found after parsing."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)
    return status


def _groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    return [g for g in parser._action_groups if g.title and g._group_actions]


def show_filtered_help(parser: argparse.ArgumentParser, keyword: str, file: Optional[IO[str]] = None) -> int:
    """``--help=<keyword>`` (vLLM's semantics). Prints, and returns the exit status:

    * ``all``: the full help (0);
    * ``listgroup``: the titles of the flag groups (0);
    * a group title (case-insensitive, e.g. ``--help=CORS``): that group's flags (0);
    * otherwise every flag whose name contains ``keyword`` (case-insensitive, e.g.
      ``--help=max-model``) (0), or a line saying nothing matched plus a ``listgroup`` tip (1).
    """
    out = file or sys.stdout
    if keyword == "all":
        parser.print_help(out)
        return 0
    if keyword == "listgroup":
        lines = ["Available argument groups:"]
        for g in _groups(parser):
            if not g.title.startswith("positional arguments"):
                lines.append(f"  - {g.title}")
        lines.append(f"Use `{parser.prog} --help=<group>` to show one group's flags, or "
                     f"`--help=<keyword>` to search flag names.")
        print("\n".join(lines), file=out)
        return 0
    for g in _groups(parser):
        if g.title.lower() == keyword.lower():
            fmt = parser._get_formatter()
            fmt.start_section(g.title)
            fmt.add_text(g.description)
            fmt.add_arguments(g._group_actions)
            fmt.end_section()
            print(fmt.format_help(), file=out, end="")
            return 0
    key = keyword.lower().lstrip("-")
    matched = [a for a in parser._actions if any(key in o.lower() for o in a.option_strings)]
    if matched:
        fmt = parser._get_formatter()
        fmt.start_section(f"Flags matching {keyword!r}")
        fmt.add_arguments(matched)
        fmt.end_section()
        print(fmt.format_help(), file=out, end="")
        return 0
    print(f"{parser.prog}: no flag group or flag matching {keyword!r} "
          f"(`{parser.prog} --help=listgroup` lists the groups)", file=out)
    return 1
