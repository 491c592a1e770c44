"""``python -m xirang``: the ``xirang`` command (xirang_compile/cli/); importing this module runs nothing."""
import sys

from xirang.cli import main

if __name__ == "__main__":
    sys.exit(main())
