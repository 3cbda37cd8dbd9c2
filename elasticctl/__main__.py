"""``python -m elasticctl``: the ``elasticctl`` command, output and exit status alike.

The console script installed as ``elasticctl`` runs ``sys.exit(main())``; so does this.
"""

import sys

from elasticctl.cli import main

if __name__ == "__main__":  # not when a tool imports every module (tests/unit/test_errors.py)
    sys.exit(main())
