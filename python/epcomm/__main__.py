"""``python -m epcomm ARGS`` and the ``epcomm`` console script: the package's epcomm CLI
(launch, doctor, bench, info, ...), with the doctor's rulebook beside it. The process becomes
the CLI (exec), so exit statuses and signals are the CLI's own."""

import os
import sys

from ._paths import cli


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    exe = cli()
    if not os.access(exe, os.X_OK):
        sys.stderr.write(f"epcomm: the CLI is missing from the package ({exe}); reinstall it\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe] + args)


if __name__ == "__main__":
    sys.exit(main())
