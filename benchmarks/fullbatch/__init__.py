"""The full-batch benchmark suite: seven problems, the peers tuned alike, Anderson acceleration's
recommended configuration and a tuned one (``python -m benchmarks.fullbatch.run``, ``make
fullbatch``; docs/fullbatch.md)."""

import os
import sys

# The comparison machinery (traces, counted runs, the peers) is the examples' (_compare.py).
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
