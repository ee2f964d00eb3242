"""``python -m treedec``: the ``treedec`` command line (:mod:`treedec.cli`)."""
import sys

from treedec.cli import main

sys.exit(main())
