"""Graph neural networks: SAGA-NN layers, models, chunk streaming plans (docs/gnn.md, issue 19).

Modules (imported on demand, so that ``import engine.gnn`` stays light):

- :mod:`engine.gnn.saga`: ``SAGALayer`` (the SAGA-NN stages and the chunk API) and the built-in
  layers ``GCNLayer``, ``GATLayer``, ``SAGELayer``, ``GINLayer``, ``GatedGCNLayer``.
- :mod:`engine.gnn.models`: ``GNNConfig``, ``GNNModel``, ``build_gnn``, ``GNN_KINDS``.

Their errors (``GNNError``, ``PartitionError``, ``GNNPlanError``, ``CharacterizeError``) are in
:mod:`engine.errors`.
"""
