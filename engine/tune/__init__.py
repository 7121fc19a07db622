"""``tessel tune``: the best parallel configuration of a model on a cluster, searched over the
planner's cost model (:mod:`engine.tune.space`: what may vary; :mod:`engine.tune.tuner`: the
search, its bounds and ranking; :mod:`engine.tune.report`: the table, the runner-up line and the
nothing-fits sentence; :mod:`engine.tune.export`: the winner as a torchtitan job config and
Megatron-LM arguments).

The tuner captures models, so it imports torch: its names are loaded on first use (PEP 562), and
``engine.tune.space`` / ``engine.tune.report`` stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.lazy_names import load_lazy_name
from engine.tune.space import Candidate, TuneSpace, TuneSpaceError, candidates

if TYPE_CHECKING:
    from engine.tune.tuner import STATUSES, TuneResult, TuneRow, pareto_front, plan_candidate, tune

#: Names loaded on first use, from the module that imports torch.
_LAZY = {name: "engine.tune.tuner" for name in ("STATUSES", "TuneResult", "TuneRow", "pareto_front",
                                                "plan_candidate", "tune")}

__all__ = ["Candidate", "STATUSES", "TuneResult", "TuneRow", "TuneSpace", "TuneSpaceError", "candidates",
           "pareto_front", "plan_candidate", "tune"]


def __getattr__(name: str) -> Any:
    """PEP 562: ``engine.tune.tune`` and the other names of :data:`_LAZY`, imported on first use."""
    return load_lazy_name(__name__, _LAZY, globals(), name)
