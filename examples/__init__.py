"""Aliases of :mod:`gradshard.examples` in a source checkout.

The example models, the offline data, the factories and the training scripts ship inside the
package (:mod:`gradshard.examples`). Every module here (``examples.data``,
``examples.factories``, ``examples.models.*``, ``examples.train_*``) is the package's module
object under its old name, and ``python examples/train_lasp.py`` runs
``python -m gradshard.examples.train_lasp``.
"""
