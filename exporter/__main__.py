"""``python -m elx.exporter ...`` (or, from a checkout's root, ``python -m exporter ...``) does what ``elx export ...`` does."""
import sys

from elx.cli import export_main

sys.exit(export_main())
