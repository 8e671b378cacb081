"""Alias of :mod:`gradshard.examples.train_ssm`, where the code lives (it ships in the wheel).

``python examples/train_ssm.py ...`` (and ``torchrun ... examples/train_ssm.py ...``) runs it, as
``python -m gradshard.examples.train_ssm ...`` does anywhere; imported, this name is the package's
module object itself.
"""

import runpy
import sys

if __name__ == "__main__":
    runpy.run_module("gradshard.examples.train_ssm", run_name="__main__", alter_sys=True)
else:
    import gradshard.examples.train_ssm as _module

    sys.modules[__name__] = _module
