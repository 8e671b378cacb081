"""Example user models and offline data for gradshard.

Everything here is plain PyTorch written the way users and reference implementations write
it; gradshard captures and rewrites these models, they never depend on gradshard internals
(the only exception: the optional ``scan="gradshard"`` / ``attn_impl="gradshard"`` switches,
which call the public ``gradshard.kernels`` functions, imported lazily).
"""
