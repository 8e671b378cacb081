"""Aliases of :mod:`gradshard.examples.models` (``examples.models.ssm`` and so on)."""
