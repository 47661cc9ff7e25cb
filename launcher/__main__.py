"""``python -m horolite.launcher`` is ``horolite-run``."""
import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
