"""Alias of :mod:`gradshard.examples.train_partial`, where the code lives (it ships in the wheel).

``python examples/train_partial.py ...`` (and ``torchrun ... examples/train_partial.py ...``) runs it, as
``python -m gradshard.examples.train_partial ...`` does anywhere; imported, this name is the package's
module object itself.
"""

import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("gradshard.examples.train_partial", run_name="__main__", alter_sys=True)
else:
    import gradshard.examples.train_partial as _module

    sys.modules[__name__] = _module
