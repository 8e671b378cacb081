"""Alias of :mod:`gradshard.examples.models.linear_attention`, where the code lives (it ships in the wheel).

Kept so that ``import examples.models.linear_attention`` works in a source checkout: this entry in
``sys.modules`` is the package's module object itself, not a copy.
"""

import sys

import gradshard.examples.models.linear_attention as _module

sys.modules[__name__] = _module
