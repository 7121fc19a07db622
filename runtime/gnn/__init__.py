"""Executing GNNs (docs/gnn.md, issue 19).

Modules (imported on demand):

- :mod:`runtime.gnn.streaming`: single-process chunk-streamed execution of a
  :class:`engine.gnn.models.GNNModel` on an :class:`engine.gnn.partition.GraphPartition` (NGra,
  USENIX ATC'19, section 4): ``StreamedGNN``, ``train_step``, ``predict``, ``ChunkRecord``.
- :mod:`runtime.gnn.memory`: the peak memory of a function in a fresh subprocess
  (``measure_peak_bytes``, ``measure_peak``).
"""

from __future__ import annotations
