"""``python -m vattn``: the command line (:mod:`vattn.cli.main`)."""

import sys

from vattn.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
