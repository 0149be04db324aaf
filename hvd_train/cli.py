"""The `hvd-train` command line: parses, then calls one library function per subcommand."""

from __future__ import annotations

import argparse
import sys

from hvd_train import doctor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvd-train", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "doctor", help="versions of the stack, what Horovod was built with, and what is wrong"
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor.run(sys.stdout)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
