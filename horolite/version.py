"""horolite's version: the one place it is written (setup.py reads this file)."""
__version__ = "0.1.0"
