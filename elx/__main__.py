"""``python -m elx ...`` is the ``elx`` command."""
import sys

from elx.cli import main

sys.exit(main())
