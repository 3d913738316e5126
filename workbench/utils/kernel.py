"""Are we inside a Jupyter kernel (where widgets and rich outputs render), or in a script, test or
terminal?"""

from __future__ import annotations

import sys
from typing import Any


def kernel_shell() -> Any:
    """The IPython shell when running inside a Jupyter kernel (papermill included), else None."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        # never imported: certainly not in a kernel, and importing it would cost time
        return None
    shell = ipython.get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


def in_kernel() -> bool:
    return kernel_shell() is not None
