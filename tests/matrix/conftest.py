"""The matrix reuses the optimizer tests' float64 checks and budgets (tests/optim/optim_helpers.py,
tests/optim/apex_optim_helpers.py), which import each other by module name: their folder goes on the path."""

import sys
from pathlib import Path

_OPTIM = str(Path(__file__).resolve().parent.parent / "optim")
if _OPTIM not in sys.path:
    sys.path.insert(0, _OPTIM)
