"""The `speculant` command line: its parser (`parser`: every command's flags), what a command refuses before a model
loads (`checks`), and the commands (`generate`, `serve`, `bench` with `bench-serve` and `bench-kernels`, and
`analysis`: `profile`, `acceptance`, `train-depth`, `simulate`). Errors print one line and exit with code 2."""

from __future__ import annotations

import errno
import os
import select
import sys
from collections.abc import Sequence

from speculant.cli.analysis import run_acceptance, run_profile, run_simulate, run_train_depth
from speculant.cli.bench import run_bench, run_bench_kernels, run_bench_serve, run_peers
from speculant.cli.checks import check_needs, check_outputs
from speculant.cli.generate import run_generate
from speculant.cli.parser import build_parser
from speculant.cli.serve import run_serve
from speculant.errors import SpeculantError, interrupted

COMMANDS = {"generate": run_generate, "serve": run_serve, "bench-serve": run_bench_serve,
            "bench-kernels": run_bench_kernels, "peers": run_peers, "profile": run_profile, "acceptance": run_acceptance,
            "train-depth": run_train_depth, "simulate": run_simulate}  # (and bench)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)  # (a usage error exits 2 from inside)
        check_outputs(args)
        check_needs(args)
        if args.command == "bench":  # (which records its command line)
            run_bench(args, argv)
        else:
            COMMANDS[args.command](args)
    except SpeculantError as error:  # (one line, whatever a library's message spanned)
        print(f"speculant: error: {' '.join(line.strip() for line in str(error).splitlines())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        return interrupted(error)
    except BrokenPipeError:
        if not reader_gone():  # (another pipe: a server process's, a socket's)
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        return 141  # quietly, as a shell's tools end on SIGPIPE (128 + 13)
    except OSError as error:  # the machine's answer to a write (a disk full, /dev/full): one line, not a traceback
        where = "".join(f": {name}" for name in (error.filename, error.filename2) if name)
        print(f"speculant: error: {' '.join(str(error.strerror or error).split())}{where}", file=sys.stderr)
        return 2 if error.errno == errno.ENAMETOOLONG else 1  # (a name given too long is the input's error)
    return 0


def reader_gone() -> bool:
    """Whether standard output is a pipe whose reader went away (`speculant generate ... | head`): its end reports
    an error (POLLERR, as Linux and the BSDs report a pipe with no reader)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return bool(poller.poll(0))
    except (AttributeError, OSError, ValueError):  # (no poll; stdout no file: a test's capture)
        return False

