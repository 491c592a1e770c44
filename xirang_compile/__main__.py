import sys

from xirang.cli import main

sys.exit(main())
