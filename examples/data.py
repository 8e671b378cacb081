"""Alias of :mod:`gradshard.examples.data`, where the code lives (it ships in the wheel).

Kept so that ``import examples.data`` works in a source checkout: this entry in
``sys.modules`` is the package's module object itself, not a copy.
"""

import sys

import gradshard.examples.data as _module

sys.modules[__name__] = _module
