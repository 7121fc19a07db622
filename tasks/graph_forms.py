"""The graph specifications the planner accepts, as one sentence for help and error messages.

Kept apart from :mod:`tasks.graphs` (which imports torch and PyTorch Geometric) so that the
command line can build its help without importing them.
"""

from __future__ import annotations

#: The accepted ``--graph`` forms (:func:`tasks.graphs.graph_from_spec`).
GRAPH_FORMS = "karate, cpython or rmat:SCALE:EDGE_FACTOR (such as rmat:16:8)"
