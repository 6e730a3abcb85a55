"""``python -m exporter ...`` does what ``elx export ...`` does."""
import sys

from .cli import export_main

sys.exit(export_main())
