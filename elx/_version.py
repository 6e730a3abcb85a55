"""elx's version, in a module of its own: the exporter records it without importing the public API."""
__version__ = "0.1.0"
