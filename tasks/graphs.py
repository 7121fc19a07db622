"""Graphs for node classification (issue 19, docs/gnn.md): Zachary's karate club, the CPython code
graph (a real graph of tens of thousands of vertices built from the standard library sources),
and R-MAT power-law graphs of any size for the memory experiments.

Every builder returns a :class:`torch_geometric.data.Data` with

- ``x``: float32 ``[N, F]`` vertex features;
- ``edge_index``: int64 ``[2, E]``, row 0 the source and row 1 the destination (PyG's
  ``flow="source_to_target"``); undirected graphs hold both directions of every edge, no self
  loops and no duplicates (sorted by source, then destination, as ``torch_geometric.utils.coalesce``
  leaves them);
- ``y``: int64 ``[N]`` class labels in ``0 .. C-1``;
- ``train_mask``, ``val_mask``, ``test_mask``: bool ``[N]``, pairwise disjoint, together covering
  every vertex;
- ``name``: a short string (``"karate-club"``, ``"cpython-code-graph"``, ``"rmat-s<scale>-e<ef>"``).

:func:`validate_graph` checks these invariants; :func:`graph_stats` summarises a graph.

The CPython code graph (:func:`cpython_code_graph`)
---------------------------------------------------

A Cora-like citation graph made of code: vertices are the functions and classes of the standard
library's ``*.py`` files (found as :mod:`tasks.corpus` finds them: ``sysconfig``'s ``stdlib`` path,
``site-packages`` and ``__pycache__`` skipped, sorted by relative path; each file parsed with
:mod:`ast`; files that do not parse, such as the deliberately broken test inputs, are skipped).

*Vertices.* Every ``def``, ``async def`` and ``class`` statement, nested ones included, named by its
module and ``__qualname__`` (``asyncio.events.AbstractEventLoop.run_forever``,
``json.decoder.py_scanstring``, ``functools.lru_cache.<locals>.decorating_function``). Two
statements with the same qualified name (the two branches of an ``if sys.platform == ...``) are one
vertex that holds both bodies. A module ``a/b.py`` is ``a.b``; ``a/__init__.py`` is ``a``.

*Edges: resolved references.* Each vertex owns the code of its statement (decorators, bases,
argument defaults and annotations, body) except the nested definitions, which are vertices of
their own. Every name ``n`` and attribute chain ``n.a.b`` it loads is resolved, in this order:

1. ``self.m`` / ``cls.m`` (the first parameter of a method that is not a ``staticmethod``): the
   member ``m`` of the enclosing class, else of its base classes (those that resolve by these
   rules, depth first, as an approximation of the MRO).
2. The lexical scopes, innermost first, as Python looks names up: a function's nested definitions
   and its local ``import`` / ``from ... import`` aliases; a name assigned in the function (a
   parameter, an assignment target, a ``for`` / ``with`` / comprehension variable) is a local
   variable and is dropped. Class scopes are skipped, except a class's own body, which sees its
   members.
3. The module's namespace: its top-level definitions (also those inside top-level ``if`` / ``try``
   blocks), then its ``import`` aliases (``import a.b`` binds ``a``, ``import a.b as c`` binds
   ``c`` to ``a.b``, ``from m import n as k`` binds ``k`` to ``m.n``; relative imports are
   resolved against the module's package), then module-level aliases ``X = Y`` / ``X = m.Y``, then
   the modules of its ``from m import *`` (``__all__`` is not consulted).
4. An absolute dotted name (what an import alias points at) is split at its longest prefix that is
   a module of the corpus; the rest is looked up in that module's namespace (rule 3, so re-exports
   such as ``asyncio.sleep`` -> ``asyncio.tasks.sleep`` through ``from .tasks import *`` resolve).
   Past a class, the chain continues into its members (``Class.method``); past a function it stops
   (``f.__name__`` refers to ``f``).

Dropped: builtins; modules themselves (a module is not a vertex) and names of extension modules
without a ``.py`` file (``_socket``, ``_asyncio``); attributes of anything but ``self``/``cls``,
a class, or an imported module (``obj.method`` on a local variable or parameter: no type
inference); ``super().m``, ``getattr``, string references; module-level variables that are not
aliases of definitions; rebinding order (a name defined and imported in one module resolves to the
definition); ``global`` is honoured. A reference from a vertex to itself (recursion) is dropped.
Edges are made undirected (both directions), deduplicated, without self loops; edges to vertices
that are not kept (below) are removed with ``torch_geometric.utils.subgraph``.

*Labels.* A vertex's class is its *area*: the top-level package or module of the corpus that its
code belongs to (``email``, ``asyncio``, ``xml``, ``typing``, ...). CPython's test suite is credited
to the code it tests: a vertex under ``test/test_X.py`` or ``test/test_X/`` has area ``X`` when ``X``
is a top-level package or module of the corpus (``test/test_asyncio/test_events.py`` -> ``asyncio``,
``test/test_typing.py`` -> ``typing``); the rest of ``test`` (``test.support``, ``test/test_grammar.py``
...) has no area and is dropped, as are the vertices of every area but the ``num_classes`` most
frequent (ties broken by name). Class ``0`` is the most frequent area (``data.class_names``).

*Features.* A hashed bag of the identifiers a vertex owns (its own name, its parameter names, every
``Name``, attribute, keyword and imported name in its code, the names of its nested definitions),
each identifier also split into its lower-case ``snake_case`` / ``CamelCase`` words, hashed into
``feature_dim`` buckets by :class:`sklearn.feature_extraction.text.HashingVectorizer` (MurmurHash3,
counts, no sign flipping) and L2-normalised per vertex.

*Masks.* ``split="random"`` (default): the kept vertices are permuted by a ``torch.Generator``
seeded with ``seed``; the first ``train_fraction`` of them train, the next ``val_fraction``
validate, the rest test (the transductive setting of Cora). ``split="file"``: per area, its files
are shuffled with ``random.Random(seed)`` and dealt to train, val and test in that order until each
split holds its fraction of the area's vertices, so that no file is in two splits (an area whose
vertices sit in one or two files can then miss a split: ``typing``, ``socket`` ...).

*Measured* (CPython 3.11.7, defaults ``feature_dim=256, num_classes=16``): 71,126 definitions in
1,781 parsed files (9 skipped); kept N = 26,061 vertices of 778 files, E = 75,648 directed edges
(37,824 undirected), average degree 2.9, maximum degree 3,551
(``unittest.case.TestCase.assertEqual``: every test's ``self.assertEqual``), 5,004 isolated
vertices, 77% of edges join vertices of one class; 16 classes: asyncio 3,794, unittest 3,153,
idlelib 2,730, email 1,970, tkinter 1,917, importlib 1,878, typing 1,723, lib2to3 1,565, encodings
1,153, distutils 1,057, inspect 949, ctypes 911, enum 863, socket 829, xml 826, sqlite3 743. The
first build takes about 20 s on 2 cores (one process; 18 s of it parsing), a cached load 0.1 s.

*Cache.* The graph is saved with :func:`torch.save` (a dict of tensors and strings, loaded with
``weights_only=True``) as ``<cache_dir>/code-graph-<key>.pt``, written atomically (temporary file
in the same folder, fsync, :func:`os.replace`). The key is the SHA-256 of the builder's version,
every argument that changes the graph, and each input file's relative path and SHA-256 of its
bytes; a load recomputes it and rebuilds (overwriting the file) when the stored key differs or the
file cannot be read, so an edited corpus never serves a stale graph.

R-MAT (:func:`rmat_graph`)
--------------------------

Chakrabarti, Zhan and Faloutsos, "R-MAT: A Recursive Model for Graph Mining" (SDM 2004),
generated as the Graph500 Kronecker generator does (Graph500 reference code, ``generator/``): each
of the ``edge_factor * 2**scale`` edges picks one of the four quadrants of the adjacency matrix
with probabilities ``a, b, c, d = 1 - a - b - c`` at each of ``scale`` recursion levels (the stochastic
Kronecker graph of the initiator ``[[a, b], [c, d]]``, Leskovec et al., JMLR 2010), all edges at once:
four levels per draw, one ``torch.rand`` and one ``torch.bucketize`` over the 256 cells of the
initiator's fourth Kronecker power, no loop over edges. Vertex ids are then permuted at random
(Graph500), self loops removed, and duplicates merged.

Sources: PyTorch Geometric (``torch_geometric.datasets.KarateClub``, ``torch_geometric.utils``),
scikit-learn (``HashingVectorizer``), the papers above; Zachary, "An Information Flow Model for
Conflict and Fission in Small Groups" (1977).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import pickle
import random
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.datasets import KarateClub
from torch_geometric.utils import contains_self_loops, degree, is_undirected, subgraph, to_undirected

from engine.errors import GraphError
from engine.io.atomic import atomic_write_bytes
from engine.io.cache import cache_dir as tessel_cache_dir
from tasks.corpus import _find_py_files, stdlib_root
from tasks.graph_forms import GRAPH_FORMS

__all__ = [
    "CODE_GRAPH_VERSION",
    "GRAPH_FORMS",
    "graph_from_spec",
    "cpython_code_graph",
    "graph_stats",
    "karate_club",
    "random_masks",
    "rmat_graph",
    "validate_graph",
]

log = logging.getLogger(__name__)

CODE_GRAPH_VERSION = 1
"""Version of the code-graph builder; part of the cache key (bump it when the graph changes)."""


# ----------------------------------------------------------------------------- checks and statistics
def validate_graph(data: Data, undirected: bool = True) -> None:
    """Check the invariants of the module docstring.

    Args:
        data: a graph with ``x`` ``[N, F]`` float32, ``edge_index`` ``[2, E]`` int64, ``y`` ``[N]``
            int64 and the three bool masks ``[N]``.
        undirected: also require every edge in both directions.

    Raises:
        GraphError: the first invariant that does not hold (shapes, dtypes, vertex ids out of
            range, self loops, duplicate or one-way edges, overlapping or non-covering masks,
            negative labels).
    """

    x, ei, y = getattr(data, "x", None), getattr(data, "edge_index", None), getattr(data, "y", None)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32:
        raise GraphError("data.x must be a float32 tensor [N, F]; convert it with x.float()")
    n = x.shape[0]
    if not isinstance(ei, torch.Tensor) or ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype != torch.int64:
        raise GraphError("data.edge_index must be an int64 tensor [2, E] (row 0 source, row 1 destination)")
    if not isinstance(y, torch.Tensor) or y.shape != (n,) or y.dtype != torch.int64:
        raise GraphError(f"data.y must be an int64 tensor [{n}] of class labels")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= n):
        raise GraphError(f"data.edge_index holds vertex ids outside 0..{n - 1}; renumber the edges")
    if n and int(y.min()) < 0:
        raise GraphError("data.y holds negative labels; labels must be 0 .. num_classes - 1")
    if contains_self_loops(ei):
        raise GraphError("data.edge_index holds self loops; drop them with torch_geometric.utils.remove_self_loops")
    key = ei[0] * max(n, 1) + ei[1]
    if torch.unique(key).numel() != key.numel():
        raise GraphError("data.edge_index holds duplicate edges; merge them with torch_geometric.utils.coalesce")
    if undirected and not is_undirected(ei, num_nodes=n):
        raise GraphError("data.edge_index is not symmetric; add the reverse edges with "
                         "torch_geometric.utils.to_undirected")
    masks = []
    for name in ("train_mask", "val_mask", "test_mask"):
        m = getattr(data, name, None)
        if not isinstance(m, torch.Tensor) or m.shape != (n,) or m.dtype != torch.bool:
            raise GraphError(f"data.{name} must be a bool tensor [{n}]")
        masks.append(m.long())
    total = masks[0] + masks[1] + masks[2]
    if n and int(total.max()) > 1:
        raise GraphError("the train, val and test masks overlap; every vertex must be in exactly one split")
    if n and int(total.min()) < 1:
        raise GraphError("the train, val and test masks do not cover every vertex; put each vertex in one split")


def graph_stats(data: Data) -> dict[str, Any]:
    """Summary statistics of a graph (for tables, plans and the partition planner).

    Returns:
        ``{"name", "num_nodes", "num_edges", "avg_degree", "max_degree", "feature_dim",
        "num_classes", "isolated"}``: ``num_edges`` counts directed edges (an undirected edge
        twice), ``avg_degree = num_edges / num_nodes``, ``max_degree`` is the largest in-degree
        (edges into one vertex: a gather's fan-in; equal to the out-degree on a symmetric graph,
        computed with ``torch_geometric.utils.degree``), ``num_classes`` is
        ``len(data.class_names)`` when present, else ``max(y) + 1``, ``isolated`` counts vertices
        without edges.

    Raises:
        GraphError: ``data`` has no ``x`` / ``edge_index``.
    """

    x, ei = getattr(data, "x", None), getattr(data, "edge_index", None)
    if not isinstance(x, torch.Tensor) or not isinstance(ei, torch.Tensor):
        raise GraphError("graph_stats needs a Data with x [N, F] and edge_index [2, E]")
    n, e = int(x.shape[0]), int(ei.shape[1])
    deg = degree(ei[1], n, dtype=torch.long) if n else torch.zeros(0, dtype=torch.long)
    out_deg = degree(ei[0], n, dtype=torch.long) if n else deg
    y = getattr(data, "y", None)
    names = getattr(data, "class_names", None)
    if names is not None:
        classes = len(names)
    elif isinstance(y, torch.Tensor) and y.numel():
        classes = int(y.max()) + 1
    else:
        classes = 0
    return {
        "name": str(getattr(data, "name", "graph")),
        "num_nodes": n,
        "num_edges": e,
        "avg_degree": e / n if n else 0.0,
        "max_degree": int(deg.max()) if n else 0,
        "feature_dim": int(x.shape[1]),
        "num_classes": classes,
        "isolated": int(((deg + out_deg) == 0).sum()),
    }


def random_masks(num_nodes: int, train_fraction: float, val_fraction: float,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Disjoint, covering bool masks ``[num_nodes]`` from a permutation seeded by ``seed``: the first
    ``round(train_fraction * N)`` permuted vertices train, the next ``round(val_fraction * N)``
    validate, the rest test.

    Raises:
        GraphError: a fraction is outside ``(0, 1)`` or ``train_fraction + val_fraction >= 1``.
    """
    _check_fractions(train_fraction, val_fraction)
    perm = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(int(seed)))
    n_train = round(train_fraction * num_nodes)
    n_val = round(val_fraction * num_nodes)
    masks = []
    for lo, hi in ((0, n_train), (n_train, n_train + n_val), (n_train + n_val, num_nodes)):
        m = torch.zeros(num_nodes, dtype=torch.bool)
        m[perm[lo:hi]] = True
        masks.append(m)
    return masks[0], masks[1], masks[2]


def _check_fractions(train_fraction: float, val_fraction: float) -> None:
    if not (0.0 < train_fraction < 1.0 and 0.0 < val_fraction < 1.0 and train_fraction + val_fraction < 1.0):
        raise GraphError(f"train_fraction={train_fraction} and val_fraction={val_fraction} must each be in (0, 1) "
                         "with a sum below 1 (the rest is the test split)")


# ----------------------------------------------------------------------------- karate club
def karate_club() -> Data:
    """Zachary's karate club: 34 members, 78 friendships (156 directed edges), 4 classes.

    From ``torch_geometric.datasets.KarateClub`` (bundled with PyG, nothing downloaded): ``x`` is
    the identity ``[34, 34]`` (one-hot vertex ids), ``y`` the 4 communities PyG ships (a
    modularity-based clustering). Masks: PyG's ``train_mask`` (one labelled member per class:
    vertices 0, 4, 8, 24); the other 30 vertices are permuted with seed 0, 10 validate and 20 test.

    Source: Zachary (1977); PyG's ``KarateClub`` dataset. The same edges are
    ``networkx.karate_club_graph()`` (checked in the tests).
    """

    d = KarateClub()[0]
    train = d.train_mask.clone()
    rest = (~train).nonzero().flatten()
    rest = rest[torch.randperm(rest.numel(), generator=torch.Generator().manual_seed(0))]
    val = torch.zeros_like(train)
    test = torch.zeros_like(train)
    val[rest[:10]] = True
    test[rest[10:]] = True
    return Data(x=d.x.float().contiguous(), edge_index=d.edge_index.long().contiguous(), y=d.y.long().contiguous(),
                train_mask=train, val_mask=val, test_mask=test, name="karate-club",
                class_names=[f"community-{i}" for i in range(int(d.y.max()) + 1)])


# ----------------------------------------------------------------------------- R-MAT
_RMAT_GROUP = 4
"""Recursion levels drawn at once by :func:`rmat_graph` (one categorical over the 4**k cells of the
initiator's k-th Kronecker power: the same distribution as k single levels, fewer passes)."""


def _dedupe(src: torch.Tensor, dst: torch.Tensor, num_nodes: int, undirected: bool) -> torch.Tensor:
    """``edge_index`` int64 ``[2, E']`` of the edges ``src -> dst`` (int64 ``[E]``) without self loops
    and duplicates, with the reverse of each edge when ``undirected``, sorted by (source,
    destination): what ``torch_geometric.utils.to_undirected`` / ``coalesce`` return after
    ``remove_self_loops`` (checked in the tests), computed with one NumPy sort of ``src << bits | dst``
    keys (a few times faster than ``coalesce`` on tens of millions of edges)."""

    bits = max(1, (num_nodes - 1).bit_length())          # key = src << bits | dst sorts as (src, dst)
    keep = src != dst
    s, d = src[keep].numpy(), dst[keep].numpy()
    keys = np.concatenate([(s << bits) | d, (d << bits) | s]) if undirected else (s << bits) | d
    del s, d
    keys.sort()
    first = np.empty(keys.shape[0], dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    keys = keys[first]
    out = np.empty((2, keys.shape[0]), dtype=np.int64)
    np.right_shift(keys, bits, out=out[0])
    np.bitwise_and(keys, (1 << bits) - 1, out=out[1])
    return torch.from_numpy(out)


def rmat_graph(scale: int, edge_factor: int, a: float = 0.57, b: float = 0.19, c: float = 0.19, seed: int = 0,
               feature_dim: int = 64, num_classes: int = 8, undirected: bool = True, permute: bool = True,
               train_fraction: float = 0.6, val_fraction: float = 0.2) -> Data:
    """An R-MAT power-law graph with synthetic, learnable features and labels.

    ``2**scale`` vertices; ``edge_factor * 2**scale`` edges are drawn (see the module docstring),
    then self loops are removed, the graph is symmetrised when ``undirected`` and duplicates are
    merged, so ``E <= 2 * edge_factor * 2**scale`` (``<= edge_factor * 2**scale`` directed).
    Measured on 2 shared cores: ``scale=20, edge_factor=16`` gives 31.4 M directed edges (max
    degree 64,691, 402 k isolated vertices) in 7 to 14 s, about half of it the four vectorised
    draws and half the deduplication (no timing is asserted in the tests).

    Features ``x``: float32 ``[N, feature_dim]`` standard normal; labels ``y = argmax(x @ W)`` for a
    standard normal ``W`` ``[feature_dim, num_classes]`` (a random linear projection, so a model
    can learn it from the features). Masks: :func:`random_masks`. All draws come from one
    ``torch.Generator`` seeded with ``seed``.

    Args:
        scale: log2 of the vertex count, 1..30.
        edge_factor: edges drawn per vertex, >= 1.
        a, b, c: quadrant probabilities (top-left, top-right, bottom-left); ``d = 1 - a - b - c``.
            Graph500 uses 0.57, 0.19, 0.19 (d = 0.05); ``a = b = c = 0.25`` is a uniform
            (Erdos-Renyi-like) graph.
        seed: seeds everything.
        feature_dim, num_classes: width of ``x`` (>= 1) and number of classes (>= 2).
        undirected: add the reverse of every edge.
        permute: shuffle vertex ids (Graph500) so that id order carries no degree information.
        train_fraction, val_fraction: mask fractions.

    Raises:
        GraphError: an argument is out of range.
    """
    if not isinstance(scale, int) or not 1 <= scale <= 30:
        raise GraphError(f"rmat_graph scale={scale!r} must be an int in 1..30 (2**scale vertices)")
    if not isinstance(edge_factor, int) or edge_factor < 1:
        raise GraphError(f"rmat_graph edge_factor={edge_factor!r} must be an int >= 1 (edges drawn per vertex)")
    d = 1.0 - a - b - c
    if min(a, b, c) <= 0 or d <= 0:
        raise GraphError(f"rmat_graph needs a, b, c > 0 with a + b + c < 1, got a={a}, b={b}, c={c}")
    if feature_dim < 1 or num_classes < 2:
        raise GraphError(f"rmat_graph needs feature_dim >= 1 and num_classes >= 2, got {feature_dim} and {num_classes}")
    _check_fractions(train_fraction, val_fraction)
    n = 1 << scale
    m = edge_factor * n
    gen = torch.Generator().manual_seed(int(seed))
    initiator = torch.tensor([[a, b], [c, d]], dtype=torch.float64)
    src = torch.zeros(m, dtype=torch.int32)
    dst = torch.zeros(m, dtype=torch.int32)
    done = 0
    while done < scale:           # _RMAT_GROUP recursion levels per vectorised draw
        k = min(_RMAT_GROUP, scale - done)
        kron = initiator
        for _ in range(k - 1):
            kron = torch.kron(kron, initiator)    # [2**k, 2**k]: P(k source bits, k destination bits)
        cdf = kron.flatten().cumsum(0)[:-1].float()
        cell = torch.bucketize(torch.rand(m, generator=gen), cdf, right=True, out_int32=True)
        src.bitwise_or_((cell >> k) << done)
        dst.bitwise_or_((cell & ((1 << k) - 1)) << done)
        done += k
        del cell
    src64, dst64 = src.long(), dst.long()
    del src, dst
    if permute:
        perm = torch.randperm(n, generator=gen)
        src64, dst64 = perm[src64], perm[dst64]
    edge_index = _dedupe(src64, dst64, n, undirected)
    del src64, dst64
    x = torch.randn(n, feature_dim, generator=gen)
    w = torch.randn(feature_dim, num_classes, generator=gen)
    y = (x @ w).argmax(dim=1)
    train, val, test = random_masks(n, train_fraction, val_fraction, int(seed))
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train, val_mask=val, test_mask=test,
                name=f"rmat-s{scale}-e{edge_factor}", class_names=[f"class-{i}" for i in range(num_classes)])


# ----------------------------------------------------------------------------- CPython code graph: parsing
_DEF_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


@dataclass
class _Def:
    """One definition of a module (a vertex before resolution); indices are module-local."""

    qualname: str
    kind: Literal["function", "class"]
    parent: int                                    # enclosing definition, -1 at module level
    self_name: str | None = None                   # first parameter of a method, for self.m / cls.m
    tokens: list[str] = field(default_factory=list)
    refs: set[tuple[str, ...]] = field(default_factory=set)
    bases: list[tuple[str, ...]] = field(default_factory=list)
    children: dict[str, int] = field(default_factory=dict)   # nested definitions (class: members)
    imports: dict[str, str] = field(default_factory=dict)    # local alias -> absolute dotted name
    local_vars: set[str] = field(default_factory=set)


@dataclass
class _Module:
    name: str
    rel: str
    area: str | None
    defs: list[_Def] = field(default_factory=list)
    top: dict[str, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    assigns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    stars: list[str] = field(default_factory=list)
    offset: int = 0


def _module_name(rel: Path) -> tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _absolute(module: str, is_package: bool, target: str | None, level: int) -> str | None:
    """The absolute module named by ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(base) or (level - 1 == len(base) and not target):
        return None
    base = base[: len(base) - (level - 1)]
    return ".".join(base + (target.split(".") if target else [])) or None


def _chain(node: ast.expr) -> tuple[tuple[str, ...] | None, list[str], ast.expr | None]:
    """``a.b.c`` -> (("a", "b", "c"), attrs, None); ``f().b`` -> (None, ["b"], <the call>)."""
    attrs: list[str] = []
    n = node
    while isinstance(n, ast.Attribute):
        attrs.append(n.attr)
        n = n.value
    attrs.reverse()
    if isinstance(n, ast.Name):
        return (n.id, *attrs), attrs, None
    return None, attrs, n


def _words(ident: str) -> list[str]:
    words = [w.lower() for w in _WORDS.findall(ident)]
    return [ident, *words] if len(words) != 1 or words[0] != ident else [ident]


class _ModuleScanner:
    """Walks one parsed module, filling a :class:`_Module` with definitions and raw references."""

    def __init__(self, mod: _Module, is_package: bool):
        self.mod = mod
        self.is_package = is_package

    def _import_target(self, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
        """``(bound name, absolute dotted target)``; target ``None`` for a star import's module."""
        out: list[tuple[str, str | None]] = []
        if isinstance(node, ast.Import):
            for al in node.names:
                if al.asname:
                    out.append((al.asname, al.name))
                else:
                    head = al.name.split(".")[0]
                    out.append((head, head))
            return out
        base = _absolute(self.mod.name, self.is_package, node.module, node.level)
        if base is None:
            return out
        for al in node.names:
            if al.name == "*":
                out.append(("*", base))
            else:
                out.append((al.asname or al.name, f"{base}.{al.name}"))
        return out

    def scan_module(self, tree: ast.Module) -> None:
        stores: set[str] = set()
        for stmt in tree.body:      # module-level aliases X = Y / X = m.Y (resolved like references)
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Name | ast.Attribute)):
                chain, _, _ = _chain(stmt.value)
                if chain is not None and chain[0] != stmt.targets[0].id:
                    self.mod.assigns[stmt.targets[0].id] = chain
        self._scan(tree, -1, "", stores)

    def _scan(self, owner: ast.AST, owner_idx: int, prefix: str, stores: set[str]) -> None:
        """Attribute the nodes of ``owner`` (not of nested definitions) to ``owner_idx``, recursing
        into nested definitions; ``prefix`` is the qualname prefix of definitions found inside."""
        d = self.mod.defs[owner_idx] if owner_idx >= 0 else None
        tokens = d.tokens if d is not None else []
        declared_global: set[str] = set()
        nested: list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = []
        stack = list(ast.iter_child_nodes(owner))
        stack.reverse()
        while stack:
            node = stack.pop()
            if isinstance(node, _DEF_TYPES):
                nested.append(node)
                continue
            if isinstance(node, ast.Attribute):
                chain, attrs, rest = _chain(node)
                for a in attrs:
                    tokens.extend(_words(a))
                if chain is not None:
                    tokens.extend(_words(chain[0]))
                    if isinstance(node.ctx, ast.Load) and d is not None:
                        d.refs.add(chain)
                elif rest is not None:
                    stack.append(rest)
                continue
            if isinstance(node, ast.Name):
                tokens.extend(_words(node.id))
                if isinstance(node.ctx, ast.Load):
                    if d is not None:
                        d.refs.add((node.id,))
                else:
                    stores.add(node.id)
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                for bound, target in self._import_target(node):
                    if target is None:
                        continue
                    if bound == "*":
                        if d is None:
                            self.mod.stars.append(target)
                        continue
                    tokens.extend(_words(bound))
                    (d.imports if d is not None else self.mod.aliases).setdefault(bound, target)
                continue
            if isinstance(node, ast.Global | ast.Nonlocal):
                declared_global.update(node.names)
                tokens.extend(w for n in node.names for w in _words(n))
            elif isinstance(node, ast.arg):
                tokens.extend(_words(node.arg))
                stores.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                tokens.extend(_words(node.arg))
            elif isinstance(node, ast.ExceptHandler) and node.name:
                stores.add(node.name)
            elif isinstance(node, ast.alias):
                pass
            children = list(ast.iter_child_nodes(node))
            children.reverse()
            stack.extend(children)
        if d is not None:
            d.local_vars = (stores - declared_global) if d.kind == "function" else set()
        for node in nested:
            self._add_def(node, owner_idx, prefix, tokens)

    def _add_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, parent: int, prefix: str,
                 parent_tokens: list[str]) -> None:
        qual = prefix + node.name
        kind: Literal["function", "class"] = "class" if isinstance(node, ast.ClassDef) else "function"
        scope = self.mod.top if parent < 0 else self.mod.defs[parent].children
        parent_tokens.extend(_words(node.name))
        if node.name in scope and self.mod.defs[scope[node.name]].qualname == qual:
            idx = scope[node.name]                     # a second definition of the same name: one vertex
        else:
            idx = len(self.mod.defs)
            self.mod.defs.append(_Def(qual, kind, parent))
            scope[node.name] = idx
        d = self.mod.defs[idx]
        d.tokens.extend(_words(node.name))
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                chain, _, _ = _chain(base)
                if chain is not None:
                    d.bases.append(chain)
        elif parent >= 0 and self.mod.defs[parent].kind == "class":
            positional = node.args.posonlyargs + node.args.args
            static = any(isinstance(dec, ast.Name) and dec.id == "staticmethod" for dec in node.decorator_list)
            if positional and not static:
                d.self_name = positional[0].arg
        child_prefix = f"{qual}." if kind == "class" else f"{qual}.<locals>."
        stores: set[str] = set(d.local_vars)
        self._scan(node, idx, child_prefix, stores)


def _area(rel: Path, top_names: set[str]) -> str | None:
    parts = rel.parts
    top = parts[0].removesuffix(".py")
    if top != "test":
        return top
    if len(parts) > 1 and parts[1].startswith("test_"):
        subject = parts[1].removesuffix(".py")[len("test_"):]
        if subject in top_names and subject != "test":
            return subject
    return None


def _parse_file(root: Path, path: Path, top_names: set[str]) -> _Module | None:
    rel = path.relative_to(root)
    name, is_package = _module_name(rel)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_bytes(), filename=str(rel))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        log.debug("code graph: skipping %s (%s)", rel, type(e).__name__)
        return None
    mod = _Module(name=name, rel=rel.as_posix(), area=_area(rel, top_names))
    _ModuleScanner(mod, is_package).scan_module(tree)
    return mod


# ----------------------------------------------------------------------------- CPython code graph: resolution
class _Resolver:
    """Resolves the raw references of every definition to global vertex ids (the rules of the
    module docstring)."""

    def __init__(self, modules: list[_Module]):
        self.modules = {m.name: m for m in modules}
        self.owner: list[_Module] = []
        for m in modules:
            m.offset = len(self.owner)
            self.owner.extend([m] * len(m.defs))
        self._memo: dict[tuple[str, tuple[str, ...]], int | None] = {}

    def _def(self, gid: int) -> _Def:
        m = self.owner[gid]
        return m.defs[gid - m.offset]

    def _descend(self, gid: int, rest: tuple[str, ...], depth: int = 0) -> int:
        for attr in rest:
            if self._def(gid).kind != "class":
                break
            member = self._member(gid, attr, depth)
            if member is None:
                break
            gid = member
        return gid

    def _member(self, cls_gid: int, attr: str, depth: int = 0) -> int | None:
        """The member ``attr`` of class ``cls_gid`` or of its resolvable bases (depth first)."""
        if depth > 8:
            return None
        m = self.owner[cls_gid]
        d = m.defs[cls_gid - m.offset]
        if attr in d.children:
            return m.offset + d.children[attr]
        for base in d.bases:
            b = self._lexical(cls_gid, base, skip_self=True)
            if b is not None and b != cls_gid and self._def(b).kind == "class":
                found = self._member(b, attr, depth + 1)
                if found is not None:
                    return found
        return None

    def resolve_absolute(self, parts: tuple[str, ...], seen: frozenset[tuple[str, str]] = frozenset()) -> int | None:
        for k in range(len(parts), 0, -1):
            mod = self.modules.get(".".join(parts[:k]))
            if mod is not None:
                return self.resolve_in_module(mod, parts[k:], seen) if k < len(parts) else None
        return None

    def resolve_in_module(self, mod: _Module, chain: tuple[str, ...],
                          seen: frozenset[tuple[str, str]] = frozenset()) -> int | None:
        memo_key = (mod.name, chain)
        top_call = not seen
        if top_call and memo_key in self._memo:
            return self._memo[memo_key]
        head = chain[0]
        result: int | None = None
        if (mod.name, head) not in seen:
            seen = seen | {(mod.name, head)}
            if head in mod.top:
                result = self._descend(mod.offset + mod.top[head], chain[1:])
            elif head in mod.aliases:
                result = self.resolve_absolute(tuple(mod.aliases[head].split(".")) + chain[1:], seen)
            elif head in mod.assigns:
                result = self.resolve_in_module(mod, mod.assigns[head] + chain[1:], seen)
            else:
                for star in mod.stars:
                    star_mod = self.modules.get(star)
                    if star_mod is not None:
                        result = self.resolve_in_module(star_mod, chain, seen)
                        if result is not None:
                            break
        if top_call:
            self._memo[memo_key] = result
        return result

    def _lexical(self, gid: int, chain: tuple[str, ...], skip_self: bool = False) -> int | None:
        """Resolve ``chain`` as code inside definition ``gid`` sees it (``skip_self``: from the
        scope that encloses ``gid``, as a class's bases are evaluated)."""
        m = self.owner[gid]
        head = chain[0]
        idx = m.defs[gid - m.offset].parent if skip_self else gid - m.offset
        first = not skip_self
        while idx >= 0:
            sd = m.defs[idx]
            if sd.kind == "function" or first:
                if head in sd.children:
                    return self._descend(m.offset + sd.children[head], chain[1:])
                if head in sd.imports:
                    return self.resolve_absolute(tuple(sd.imports[head].split(".")) + chain[1:])
                if head in sd.local_vars:
                    return None
            idx = sd.parent
            first = False
        return self.resolve_in_module(m, chain)

    def resolve(self, gid: int, chain: tuple[str, ...]) -> int | None:
        d = self._def(gid)
        if d.self_name is not None and chain[0] == d.self_name:
            if len(chain) < 2:
                return None
            m = self.owner[gid]
            cls = m.offset + d.parent
            member = self._member(cls, chain[1])
            return None if member is None else self._descend(member, chain[2:])
        return self._lexical(gid, chain)


# ----------------------------------------------------------------------------- CPython code graph: build + cache
def _inputs_key(root: Path, files: list[Path], params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": "tessel-code-graph", "version": CODE_GRAPH_VERSION, **params},
                        sort_keys=True).encode())
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _atomic_torch_save(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getbuffer())


_TENSOR_FIELDS = ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask", "vertex_file")
_LIST_FIELDS = ("class_names", "vertex_names", "files")


def _to_payload(data: Data, key: str) -> dict[str, Any]:
    payload: dict[str, Any] = {"format": "tessel-code-graph", "version": CODE_GRAPH_VERSION, "key": key,
                               "name": data.name}
    for f in _TENSOR_FIELDS:
        payload[f] = getattr(data, f)
    for f in _LIST_FIELDS:
        payload[f] = list(getattr(data, f))
    return payload


def _from_payload(payload: Any, key: str) -> Data | None:
    if not isinstance(payload, dict) or payload.get("key") != key or payload.get("version") != CODE_GRAPH_VERSION:
        return None
    if not all(isinstance(payload.get(f), torch.Tensor) for f in _TENSOR_FIELDS):
        return None
    if not all(isinstance(payload.get(f), list) for f in _LIST_FIELDS):
        return None
    n = payload["x"].shape[0]
    if any(payload[f].shape[-1] != n for f in ("y", "train_mask", "val_mask", "test_mask", "vertex_file")):
        return None
    return Data(name=payload["name"], **{f: payload[f] for f in _TENSOR_FIELDS + _LIST_FIELDS})


def _build_code_graph(root: Path, files: list[Path], feature_dim: int, num_classes: int,
                      split: str, train_fraction: float, val_fraction: float, seed: int) -> Data:
    """Parse, resolve, label, featurise and split (no cache); see :func:`cpython_code_graph`."""
    from sklearn.feature_extraction.text import HashingVectorizer

    t0 = time.perf_counter()
    top_names = {p.relative_to(root).parts[0].removesuffix(".py") for p in files}
    modules = [m for m in (_parse_file(root, p, top_names) for p in files) if m is not None]
    resolver = _Resolver(modules)
    n_all = len(resolver.owner)
    t_parse = time.perf_counter() - t0

    src: list[int] = []
    dst: list[int] = []
    for m in modules:
        for i, d in enumerate(m.defs):
            gid = m.offset + i
            for chain in d.refs:
                target = resolver.resolve(gid, chain)
                if target is not None and target != gid:
                    src.append(gid)
                    dst.append(target)
    edge_index = to_undirected(torch.tensor([src, dst], dtype=torch.long).reshape(2, -1), num_nodes=n_all)

    areas = Counter(m.area for m in modules for _ in m.defs if m.area is not None)
    if len(areas) < num_classes:
        raise GraphError(f"the corpus at {root} has {len(areas)} areas with definitions, fewer than "
                         f"num_classes={num_classes}; pass num_classes <= {len(areas)}")
    kept_areas = [a for a, _ in sorted(areas.items(), key=lambda kv: (-kv[1], kv[0]))[:num_classes]]
    class_of = {a: i for i, a in enumerate(kept_areas)}
    keep = torch.zeros(n_all, dtype=torch.bool)
    labels = torch.full((n_all,), -1, dtype=torch.long)
    file_of = torch.zeros(n_all, dtype=torch.long)
    kept_files = [m for m in modules if m.area in class_of and m.defs]
    for fi, m in enumerate(kept_files):
        sl = slice(m.offset, m.offset + len(m.defs))
        keep[sl] = True
        labels[sl] = class_of[str(m.area)]
        file_of[sl] = fi
    edge_index, _ = subgraph(keep, edge_index, relabel_nodes=True, num_nodes=n_all)
    kept_ids = keep.nonzero().flatten()
    y = labels[kept_ids]
    vertex_file = file_of[kept_ids]
    n = int(kept_ids.numel())

    token_lists = [d.tokens for m in kept_files for d in m.defs]
    vectorizer = HashingVectorizer(n_features=feature_dim, analyzer=lambda tokens: tokens, alternate_sign=False,
                                   norm="l2", dtype=float)
    x = torch.from_numpy(vectorizer.transform(token_lists).toarray()).float()

    if split == "random":
        train, val, test = random_masks(n, train_fraction, val_fraction, seed)
    else:
        train, val, test = (torch.zeros(n, dtype=torch.bool) for _ in range(3))
        counts = torch.bincount(vertex_file, minlength=len(kept_files)).tolist()
        rng = random.Random(seed)
        for area in kept_areas:
            fids = [fi for fi, m in enumerate(kept_files) if m.area == area]
            rng.shuffle(fids)
            total = sum(counts[f] for f in fids)
            done = 0
            for f in fids:
                dest = train if done < train_fraction * total else (
                    val if done < (train_fraction + val_fraction) * total else test)
                dest[vertex_file == f] = True
                done += counts[f]
    log.info("code graph: %d definitions in %d files parsed in %.1f s; kept %d vertices, %d edges, %d classes "
             "(%.1f s in all)", n_all, len(modules), t_parse, n, edge_index.shape[1], num_classes,
             time.perf_counter() - t0)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=train, val_mask=val, test_mask=test,
                name="cpython-code-graph", class_names=kept_areas,
                vertex_names=[f"{m.name}.{d.qualname}" for m in kept_files for d in m.defs],
                vertex_file=vertex_file, files=[m.rel for m in kept_files])


def cpython_code_graph(root: str | Path | None = None, feature_dim: int = 256, num_classes: int = 16,
                       split: Literal["random", "file"] = "random", train_fraction: float = 0.2,
                       val_fraction: float = 0.2, seed: int = 0, cache_dir: str | Path | None = None,
                       use_cache: bool = True) -> Data:
    """The CPython standard library as a node-classification graph (see the module docstring for
    the vertices, the reference resolution rules, labels, features, masks and measured sizes).

    Args:
        root: a folder searched recursively for ``*.py`` files (a package tree); ``None`` means the
            standard library (:func:`tasks.corpus.stdlib_root`).
        feature_dim: hashed feature buckets F (``x`` is ``[N, F]``), >= 1.
        num_classes: keep the vertices of this many most frequent areas (>= 2).
        split: ``"random"`` (vertices, seeded) or ``"file"`` (no file in two splits).
        train_fraction, val_fraction: the split's fractions of vertices (the test split gets the rest).
        seed: seeds the split.
        cache_dir: folder of the cache file; ``None`` means ``$TESSEL_CACHE_DIR`` or ``~/.cache/tessel``.
        use_cache: ``False`` always builds and writes nothing.

    Returns:
        A :class:`~torch_geometric.data.Data` with the fields of the module docstring plus
        ``class_names`` (area of each class), ``vertex_names`` (qualified name of each vertex),
        ``files`` (relative paths of the files the vertices come from) and ``vertex_file`` (int64
        ``[N]``, an index into ``files``).

    Raises:
        GraphError: an argument is out of range, or the corpus has fewer areas than ``num_classes``.
        DataError: ``root`` is ``None`` and the standard library sources are missing.
    """
    if feature_dim < 1:
        raise GraphError(f"feature_dim={feature_dim} must be >= 1 (hashed feature buckets)")
    if num_classes < 2:
        raise GraphError(f"num_classes={num_classes} must be >= 2 (areas kept as classes)")
    if split not in ("random", "file"):
        raise GraphError(f"split={split!r} is not a split; valid: 'random', 'file'")
    _check_fractions(train_fraction, val_fraction)
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise GraphError(f"code graph root {root} is not a folder; pass a folder of .py files or None for the stdlib")
    files = _find_py_files(root)
    if not files:
        raise GraphError(f"code graph root {root} holds no .py files")
    params = {"feature_dim": int(feature_dim), "num_classes": int(num_classes), "split": split,
              "train_fraction": float(train_fraction), "val_fraction": float(val_fraction), "seed": int(seed)}
    if not use_cache:
        return _build_code_graph(root, files, **params)  # type: ignore[arg-type]
    key = _inputs_key(root, files, params)
    path = Path(cache_dir if cache_dir is not None else tessel_cache_dir()) / f"code-graph-{key[:16]}.pt"
    if path.exists():
        try:
            data = _from_payload(torch.load(path, weights_only=True), key)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
            log.warning("code graph: ignoring unreadable cache %s (%s)", path, e)
            data = None
        if data is not None:
            log.info("code graph: loaded %s", path)
            return data
        log.warning("code graph: cache %s does not match its inputs; rebuilding", path)
    data = _build_code_graph(root, files, **params)  # type: ignore[arg-type]
    _atomic_torch_save(_to_payload(data, key), path)
    return data


#: The graph specs :func:`graph_from_spec` reads (``tessel plan --gnn --graph``, ``tessel profile-gnn --graph``).


def graph_from_spec(spec: str, seed: int = 0, **kwargs: Any) -> Data:
    """The graph a spec names: ``karate`` (:func:`karate_club`), ``cpython`` (:func:`cpython_code_graph`,
    seeded split) or ``rmat:SCALE:EDGE_FACTOR`` (:func:`rmat_graph`, seeded; ``kwargs`` such as
    ``feature_dim`` are passed on). The one parser of graph specs, used by the GNN planner, the
    launcher, the app and ``tessel profile-gnn``.

    Raises:
        GraphError: an unknown name, a wrong number of fields, or a number out of range (one sentence
            naming the forms).
    """
    name, *fields = str(spec).strip().lower().split(":")
    if name in ("karate", "cpython"):
        if fields:
            raise GraphError(f"graph {spec!r} takes no numbers; use {name}.")
        return karate_club() if name == "karate" else cpython_code_graph(seed=seed, **kwargs)
    if name == "rmat":
        form = "rmat:SCALE:EDGE_FACTOR (such as rmat:16:8)"
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise GraphError(f"graph {spec!r} needs two whole numbers, in the form {form}.")
        scale, edge_factor = int(fields[0]), int(fields[1])
        if not 1 <= scale <= 30 or edge_factor < 1:
            raise GraphError(f"graph {spec!r} needs SCALE in 1..30 and EDGE_FACTOR >= 1, such as rmat:16:8.")
        return rmat_graph(scale, edge_factor, seed=seed, **kwargs)
    raise GraphError(f"graph {spec!r} is not one this planner knows; use {GRAPH_FORMS}.")
