"""``python -m iresflow``: the ``iresflow`` command."""

from iresflow.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
