"""``python -m elasticctl.cli``: the ``elasticctl`` command."""

from elasticctl.cli import main

if __name__ == "__main__":  # not when a tool imports every module (tests/unit/test_errors.py)
    main()
