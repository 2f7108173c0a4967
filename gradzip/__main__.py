"""``python -m gradzip``: the ``gradzip`` command (``gradzip bench``, ``gradzip plan``, ``--version``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
