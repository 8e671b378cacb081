"""Alias of :mod:`gradshard.examples.train_lasp`, where the code lives (it ships in the wheel).

``python examples/train_lasp.py ...`` (and ``torchrun ... examples/train_lasp.py ...``) runs it, as
``python -m gradshard.examples.train_lasp ...`` does anywhere; imported, this name is the package's
module object itself.
"""

import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("gradshard.examples.train_lasp", run_name="__main__", alter_sys=True)
else:
    import gradshard.examples.train_lasp as _module

    sys.modules[__name__] = _module
