"""The `speculant` command (and `python -m speculant`): the CLI (`speculant.cli`), imported here so that Ctrl-C while
its modules load is one line too."""

import signal
import sys

from speculant.errors import interrupted, terminate


def main() -> int:
    signal.signal(signal.SIGTERM, terminate)  # (a run's way out on SIGTERM is Ctrl-C's: `errors.Terminated`)
    try:
        from speculant.cli import main as run
    except KeyboardInterrupt as error:
        return interrupted(error)
    return run()


if __name__ == "__main__":
    sys.exit(main())
