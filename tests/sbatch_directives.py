"""How sbatch reads the #SBATCH lines of a batch script, re-stated in Python for the tests.

Read from SLURM's src/sbatch/opt.c (`_opt_batch_script` and `_get_argument`, 17.x-23.x): lines are
scanned from the top; a line starting with `#SBATCH` contributes its arguments, any other comment
or blank line is skipped, and the first line whose first non-blank character is not `#` ends the
scan (directives after it are silently ignored). Within a directive line whitespace separates
arguments, a backslash takes the next character literally, a double quote (and from 18.08 a single
quote) groups characters including whitespace, and an unquoted `#` ends the line. Any word
`packjob` is blanked first.
"""

from __future__ import annotations

import re

MAGIC = "#SBATCH"


def _arguments(rest: str) -> list[str]:
    rest = re.sub("packjob", "       ", rest, flags=re.IGNORECASE)
    args: list[str] = []
    i, n = 0, len(rest)
    while True:
        while i < n and rest[i].isspace():
            i += 1
        if i >= n:
            return args
        word, quote, escape = "", "", False
        while i < n and (quote or not rest[i].isspace()):
            c = rest[i]
            i += 1
            if escape:
                escape = False
            elif c == "\\":
                escape = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote = c
                continue
            elif c == "#":
                return [*args, word] if word else args  # the rest of the line is a comment
            word += c
        if quote:
            raise ValueError(f"sbatch: unmatched {quote} in {rest!r}")
        args.append(word)


def sbatch_directives(script: str) -> list[str]:
    """The options sbatch takes from the script's #SBATCH lines, in order."""
    options: list[str] = []
    for line in script.split("\n"):
        if line.startswith(MAGIC):
            options += _arguments(line[len(MAGIC) :])
        elif line.strip() and not line.lstrip().startswith("#"):
            break  # the first command: sbatch stops reading directives here
    return options
