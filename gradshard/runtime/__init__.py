"""Run-time machinery shared by several plans: point-to-point and collective communication
with timeouts (``comm``), the gradient/loss reductions built on it (``reduce``), and the
per-signature compile cache for the graphs regions run per shard (``compiled``), and the
forward's autocast state that a recomputing backward re-enters (``autocast``)."""
