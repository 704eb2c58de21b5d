"""The plan search (temporary re-export while the package is split)."""
from .driver import *  # noqa: F401,F403
from .driver import (_lmax, _option_arrays, _random_assignment, _safe_ridge_applies)  # noqa: F401
