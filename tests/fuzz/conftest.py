"""Hypothesis profiles and shared fixtures of the fuzz suite (issue 20).

Profiles (``HYPOTHESIS_PROFILE`` selects one; ``ci`` by default):

* ``ci``: a fixed, small budget per test (``max_examples`` below, scaled down further by the tests
  whose cases are slow), derandomized so CI runs the same cases every time, no deadline (a case's
  time depends on the machine's load); the whole suite stays well under a minute on 2 cores.
* ``long``: many more cases, random, for a soak run by hand, e.g.
  ``HYPOTHESIS_PROFILE=long timeout 660 pytest tests/fuzz -p no:cacheprovider``.

Tests scale their case count from the loaded profile's ``max_examples`` (40 under ``ci``): a test
with ``examples(10)`` runs 10 cases under ``ci`` and 100 times as many under ``long``.

The fixtures give valid documents (small placements and plans built by the engine's own writers)
that the tests then mutate (:func:`mutate`): a field deleted or renamed, a value of another
type, a huge, negative or non-finite number, a list element swapped, duplicated or dropped.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=40, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("long", max_examples=40 * 100, derandomize=False, print_blob=True, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

#: Values that replace a field: other types, empty containers, edge and non-finite numbers.
ODD_VALUES: list[Any] = [
    None, True, False, "", "x", "0", [], {}, [1], {"a": 1}, 0, -1, 1, 2, 7, 1.5, -0.5, 10**30, -(10**30),
    2**63, 1e308, math.nan, math.inf, -math.inf,
]


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (a tuple of keys and indices) into a JSON value, the root included."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _odd(data: st.DataObject, label: str) -> Any:
    """A fresh copy of one of :data:`ODD_VALUES` (mutations must never alter the shared ones)."""
    return copy.deepcopy(data.draw(st.sampled_from(ODD_VALUES), label=label))


def mutate(data: st.DataObject, doc: Any, max_mutations: int = 3) -> Any:
    """A copy of the JSON value ``doc`` with 1..``max_mutations`` random mutations drawn from ``data``."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, max_mutations), label="mutations")):
        paths = _paths(doc)
        path = data.draw(st.sampled_from(paths), label="path")
        op = data.draw(st.sampled_from(["replace", "delete", "rename", "swap", "duplicate", "drop", "number"]),
                       label="op")
        if not path:
            if op == "replace":
                doc = _odd(data, "root")
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        value = parent[key]
        if op == "replace":
            parent[key] = _odd(data, "value")
        elif op == "number":
            # a number near the old one: off by one, negated, scaled, non-finite
            base = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 1
            parent[key] = data.draw(st.sampled_from([base + 1, base - 1, -base, base * 10**6, base * 0.5, 0,
                                                     math.nan, math.inf]), label="number")
        elif op == "delete":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            parent[key + "_x" if isinstance(key, str) else key] = parent.pop(key)
        elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
            j = data.draw(st.integers(0, len(parent) - 1), label="swap with")
            parent[key], parent[j] = parent[j], parent[key]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))
        elif op == "drop" and isinstance(parent, list):
            parent.pop(key)
        else:  # an operation that does not apply here: change the value's type instead
            parent[key] = _odd(data, "value")
    return doc


def _valid_placements() -> list[Any]:
    """Small placements of every shape (split backward and inference too), as Placement objects."""
    from engine.shapes import make_shape

    out = []
    for name, n, kw in [("v", 2, {}), ("v", 3, {"split_backward": True}), ("x", 2, {}), ("m", 3, {}),
                        ("nn", 2, {}), ("k", 4, {}), ("interleaved", 2, {}), ("v", 2, {"forward_only": True})]:
        out.append(make_shape(name, n, activation=2, **kw))
    return out


@pytest.fixture(scope="session")
def valid_placement_docs() -> list[dict]:
    """Placement file documents (``tessel-placement`` v1) of small placements of every shape."""
    from engine.io.placement_json import placement_to_dict

    return [placement_to_dict(p) for p in _valid_placements()]


@pytest.fixture(scope="session")
def valid_plan_docs() -> list[dict]:
    """Plan documents (``tessel-plan`` v1) of small abstract plans: the generic GPipe and 1F1B policies
    on every small placement, and a plain 1F1B of a V pipeline."""
    from engine.baselines.generic import gpipe_any, one_f_one_b_any
    from engine.config import ModelRef, ParallelConfig
    from engine.io.plan import Plan

    docs = []
    for pl in _valid_placements():
        for build in (gpipe_any, one_f_one_b_any):
            sched = build(pl, 3)
            plan = Plan(model=ModelRef.from_dict({"name": "abstract", "source": "units"}),
                        parallel=ParallelConfig.from_dict({"dp": 1, "tp": 1, "pp": pl.num_devices,
                                                           "micro_batches": 3, "optimizer": "adam"}),
                        segments=[], schedule=sched, metrics={"makespan": 1.0})
            docs.append(plan.to_dict())
    return docs


@pytest.fixture(scope="session")
def mutate_json():
    """:func:`mutate` (a session fixture, so ``@given`` tests can take it)."""
    return mutate
