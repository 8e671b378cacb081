"""Run-time machinery shared by several plans: point-to-point and collective communication
with timeouts (``comm``) and the gradient/loss reductions built on it (``reduce``)."""
