"""python -m ringreduce.bench: see ringreduce/bench/__init__.py for what it measures and how."""
import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
