"""Plans: each folder here is one plan family (options, ordered passes, runtime modules).

Importing this package registers every plan; :func:`get_plan` and :func:`plans` read the
registry. To add a plan, add a folder and import it below (README, "Architecture": "Add a plan").
"""

from __future__ import annotations

from gradshard.plans.registry import PLANS, PlanSpec, get_plan, plans, register_plan

# Each import registers its plans (registration happens once, at import).
from gradshard.plans.none import NoneOptions  # noqa: E402
from gradshard.plans.adjoint import AdjointOptions, TruncatedAdjointOptions  # noqa: E402
from gradshard.plans.chunked import SecoOptions, SpacoOptions  # noqa: E402
from gradshard.plans.lasp import LaspOptions  # noqa: E402
from gradshard.plans.partial_update import PartialUpdateOptions  # noqa: E402

__all__ = ["PLANS", "PlanSpec", "get_plan", "plans", "register_plan", "NoneOptions", "AdjointOptions",
           "TruncatedAdjointOptions", "SecoOptions", "SpacoOptions", "LaspOptions", "PartialUpdateOptions"]
