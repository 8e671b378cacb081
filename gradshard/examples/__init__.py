"""Example user models, offline data and model factories; they ship with gradshard.

The models and the data are plain PyTorch written the way users and reference implementations
write it; gradshard captures and rewrites these models, they never depend on gradshard
internals (the only exception: the optional ``scan="gradshard"`` / ``attn_impl="gradshard"``
switches, which call the public ``gradshard.kernels`` functions, imported lazily).

- :mod:`gradshard.examples.models`: the example models (SSM, Llama, linear attention, hybrid);
- :mod:`gradshard.examples.data`: byte-level text from the Python standard library (no download);
- :mod:`gradshard.examples.factories`: ``(model_or_fn, example_inputs)`` factories, the CLI's
  built-in targets (``gradshard show ssm --plan adjoint``) and ``gradshard demo``'s model;
- ``train_ssm``, ``train_lasp``, ``train_partial``: training scripts that use gradshard
  (``python -m gradshard.examples.train_ssm``, ``torchrun --nproc-per-node 2 -m
  gradshard.examples.train_lasp``).

In a source checkout the top-level ``examples`` package aliases these modules
(``examples.models.ssm`` is ``gradshard.examples.models.ssm``, the same module object).
"""
