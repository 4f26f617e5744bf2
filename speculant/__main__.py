"""The `speculant` command (and `python -m speculant`): the CLI (`speculant.cli`), imported here so that Ctrl-C while
its modules load is one line too."""

import sys

from speculant.errors import interrupted


def main() -> int:
    try:
        from speculant.cli import main as run
    except KeyboardInterrupt:
        return interrupted()
    return run()


if __name__ == "__main__":
    sys.exit(main())
