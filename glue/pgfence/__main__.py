"""``python -m pgfence`` = the ``pgfence`` command."""

from .cli import main

main()
