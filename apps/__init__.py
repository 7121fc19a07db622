"""Entry points: the ``tessel`` CLI and the served planner app."""
