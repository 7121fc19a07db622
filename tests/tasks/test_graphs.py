"""tasks.graphs: the karate club against networkx, the invariants of every graph (checked with PyG's
own utilities), R-MAT's sizes, quadrant probabilities and heavy tail (against a uniform random
graph from networkx), the deduplication against PyG's ``to_undirected`` / ``coalesce``, the
CPython code graph (size, labels, features against scikit-learn's hashing), its reference
resolution rules on a hand-written package, its file split and its cache."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import networkx as nx
import pytest
import torch
from sklearn.feature_extraction.text import HashingVectorizer
from torch_geometric.utils import coalesce, contains_self_loops, degree, is_undirected, remove_self_loops, to_undirected

from engine.errors import GraphError
from tasks import graphs
from tasks.graphs import cpython_code_graph, graph_stats, karate_club, random_masks, rmat_graph, validate_graph


@pytest.fixture(scope="module")
def code_graph(code_graph_cache):
    return cpython_code_graph(cache_dir=code_graph_cache)


def _check_invariants(data) -> None:
    """The module docstring's invariants, checked with PyG's utilities, not with validate_graph."""
    n = data.num_nodes
    assert data.x.dtype == torch.float32 and data.x.dim() == 2 and data.x.shape[0] == n
    assert data.edge_index.dtype == torch.int64 and data.edge_index.shape[0] == 2
    assert data.y.dtype == torch.int64 and data.y.shape == (n,)
    assert 0 <= int(data.edge_index.min()) and int(data.edge_index.max()) < n
    assert not contains_self_loops(data.edge_index)
    assert is_undirected(data.edge_index, num_nodes=n)
    assert torch.equal(coalesce(data.edge_index, num_nodes=n), data.edge_index)     # no duplicates, sorted
    masks = torch.stack([data.train_mask, data.val_mask, data.test_mask])
    assert masks.dtype == torch.bool and masks.shape == (3, n)
    assert torch.equal(masks.sum(0), torch.ones(n, dtype=torch.long))              # disjoint and covering
    assert int(data.y.min()) >= 0 and int(data.y.max()) < len(data.class_names)
    assert isinstance(data.name, str) and data.name


# ----------------------------------------------------------------------------- karate club
def test_karate_club_matches_networkx():
    data = karate_club()
    ref = nx.karate_club_graph()
    assert data.num_nodes == ref.number_of_nodes() == 34
    assert ref.number_of_edges() == 78 and data.edge_index.shape == (2, 156)
    ours = {tuple(sorted(e)) for e in data.edge_index.t().tolist()}
    assert ours == {tuple(sorted(e)) for e in ref.edges()}
    assert data.train_mask.nonzero().flatten().tolist() == [0, 4, 8, 24]
    assert sorted(data.y[data.train_mask].tolist()) == [0, 1, 2, 3]               # one labelled member per class
    assert (int(data.val_mask.sum()), int(data.test_mask.sum())) == (10, 20)
    assert torch.equal(data.x, torch.eye(34))


@pytest.mark.parametrize("which", ["karate", "rmat", "code"])
def test_graph_invariants(which, request):
    if which == "karate":
        data = karate_club()
    elif which == "rmat":
        data = rmat_graph(10, 8, seed=3)
    else:
        data = request.getfixturevalue("code_graph")
    _check_invariants(data)
    validate_graph(data)                      # and our own checker agrees


def test_validate_graph_names_the_broken_invariant():
    good = karate_club()
    validate_graph(good)
    cases = {
        "self loops": torch.cat([good.edge_index, torch.tensor([[3], [3]])], 1),
        "duplicate": torch.cat([good.edge_index, good.edge_index[:, :1]], 1),
        "not symmetric": good.edge_index[:, 1:],
        "outside": torch.cat([good.edge_index, torch.tensor([[0, 40], [40, 0]])], 1),
    }
    for words, ei in cases.items():
        bad = good.clone()
        bad.edge_index = ei
        with pytest.raises(GraphError, match=words):
            validate_graph(bad)
    bad = good.clone()
    bad.val_mask = bad.val_mask | bad.train_mask
    with pytest.raises(GraphError, match="overlap"):
        validate_graph(bad)
    bad = good.clone()
    bad.test_mask = torch.zeros_like(bad.test_mask)
    with pytest.raises(GraphError, match="do not cover"):
        validate_graph(bad)
    bad = good.clone()
    bad.x = bad.x.double()
    with pytest.raises(GraphError, match="float32"):
        validate_graph(bad)


def test_graph_stats_against_networkx():
    data = karate_club()
    ref = nx.karate_club_graph()
    stats = graph_stats(data)
    assert stats["num_nodes"] == 34 and stats["num_edges"] == 156
    assert stats["avg_degree"] == pytest.approx(2 * 78 / 34)
    assert stats["max_degree"] == max(d for _, d in ref.degree())
    assert (stats["feature_dim"], stats["num_classes"], stats["isolated"]) == (34, 4, 0)
    with pytest.raises(GraphError, match="edge_index"):
        graph_stats(object())


def test_random_masks_split_and_refuse_bad_fractions():
    tr, va, te = random_masks(1000, 0.6, 0.2, seed=1)
    assert (int(tr.sum()), int(va.sum()), int(te.sum())) == (600, 200, 200)
    assert not (tr & va).any() and not (tr & te).any() and not (va & te).any()
    assert torch.equal(random_masks(1000, 0.6, 0.2, seed=1)[0], tr)
    assert not torch.equal(random_masks(1000, 0.6, 0.2, seed=2)[0], tr)
    with pytest.raises(GraphError, match="sum below 1"):
        random_masks(10, 0.8, 0.3, seed=0)


# ----------------------------------------------------------------------------- R-MAT
def test_dedupe_matches_pyg():
    gen = torch.Generator().manual_seed(0)
    n = 50
    src, dst = torch.randint(0, n, (2, 600), generator=gen)          # duplicates and self loops
    ei, _ = remove_self_loops(torch.stack([src, dst]))
    assert torch.equal(graphs._dedupe(src, dst, n, undirected=True), to_undirected(ei, num_nodes=n))
    assert torch.equal(graphs._dedupe(src, dst, n, undirected=False), coalesce(ei, num_nodes=n))


def test_rmat_sizes_and_heavy_tail():
    scale, ef = 12, 8
    data = rmat_graph(scale, ef, feature_dim=8, num_classes=4)
    n = 1 << scale
    assert data.num_nodes == n and data.x.shape == (n, 8) and data.y.shape == (n,)
    assert n * ef < data.edge_index.shape[1] <= 2 * n * ef           # symmetrised, some duplicates merged
    assert set(data.y.unique().tolist()) == {0, 1, 2, 3}
    deg = degree(data.edge_index[1], n)
    assert deg.max() > 20 * deg.mean()                               # power law: hubs
    # the uniform initiator is an Erdos-Renyi-like graph: its degrees look like networkx's G(n, m)
    uniform = rmat_graph(scale, ef, a=0.25, b=0.25, c=0.25)
    udeg = degree(uniform.edge_index[1], n)
    ref = nx.gnm_random_graph(n, uniform.edge_index.shape[1] // 2, seed=0)
    ref_max = max(d for _, d in ref.degree())
    assert 0.7 * ref_max <= udeg.max() <= 1.3 * ref_max
    assert udeg.max() < 3 * udeg.mean()


@pytest.mark.parametrize("a,b,c", [(0.57, 0.19, 0.19), (0.45, 0.25, 0.15)])
def test_rmat_quadrant_probabilities(a, b, c):
    scale = 16
    data = rmat_graph(scale, 4, a=a, b=b, c=c, undirected=False, permute=False, feature_dim=1)
    src, dst = data.edge_index
    top_src, top_dst = (src >> (scale - 1)) & 1, (dst >> (scale - 1)) & 1
    d = 1 - a - b - c
    assert top_src.float().mean().item() == pytest.approx(c + d, abs=0.01)       # bottom half of the matrix
    assert top_dst.float().mean().item() == pytest.approx(b + d, abs=0.01)       # right half
    assert (top_src & top_dst).float().mean().item() == pytest.approx(d, abs=0.01)


def test_rmat_is_seeded_and_its_labels_are_learnable():
    from sklearn.linear_model import LogisticRegression

    g1, g2 = rmat_graph(10, 8, seed=5, feature_dim=16), rmat_graph(10, 8, seed=5, feature_dim=16)
    assert torch.equal(g1.edge_index, g2.edge_index) and torch.equal(g1.x, g2.x) and torch.equal(g1.y, g2.y)
    assert not torch.equal(rmat_graph(10, 8, seed=6, feature_dim=16).edge_index, g1.edge_index)
    clf = LogisticRegression(max_iter=2000).fit(g1.x[g1.train_mask].numpy(), g1.y[g1.train_mask].numpy())
    assert clf.score(g1.x[g1.test_mask].numpy(), g1.y[g1.test_mask].numpy()) > 0.8   # 8 classes: chance 1/8


@pytest.mark.parametrize("kwargs,words", [
    ({"scale": 0, "edge_factor": 4}, "scale=0"),
    ({"scale": 4, "edge_factor": 0}, "edge_factor=0"),
    ({"scale": 4, "edge_factor": 4, "a": 0.6, "b": 0.3, "c": 0.2}, "a \\+ b \\+ c < 1"),
    ({"scale": 4, "edge_factor": 4, "num_classes": 1}, "num_classes >= 2"),
])
def test_rmat_refuses_bad_arguments(kwargs, words):
    with pytest.raises(GraphError, match=words):
        rmat_graph(**kwargs)


# ----------------------------------------------------------------------------- the CPython code graph
def test_code_graph_size_labels_and_features(code_graph):
    data = code_graph
    stats = graph_stats(data)
    assert stats["num_nodes"] >= 10_000 and stats["num_classes"] == 16 and stats["feature_dim"] == 256
    assert stats["num_edges"] > stats["num_nodes"]
    assert {"asyncio", "email", "unittest", "typing"} <= set(data.class_names)
    counts = torch.bincount(data.y, minlength=16)
    assert (counts[:-1] >= counts[1:]).all()                          # class 0 is the most frequent area
    # every vertex's label is the area of its file, recomputed from the paths
    for i in torch.randperm(data.num_nodes, generator=torch.Generator().manual_seed(0))[:300].tolist():
        parts = data.files[int(data.vertex_file[i])].split("/")
        area = parts[1].removesuffix(".py")[len("test_"):] if parts[0] == "test" else parts[0].removesuffix(".py")
        assert data.class_names[int(data.y[i])] == area
    # features: L2-normalised hashed bags holding each vertex's own name (scikit-learn's hashing)
    norms = data.x.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) and (data.x >= 0).all()
    hv = HashingVectorizer(n_features=256, analyzer=lambda t: t, alternate_sign=False, norm=None)
    for i in range(0, data.num_nodes, 997):
        own = data.vertex_names[i].rsplit(".", 1)[-1]
        bucket = hv.transform([[own]]).indices[0]
        assert data.x[i, bucket] > 0, data.vertex_names[i]


def test_code_graph_resolves_real_references(code_graph):
    names = {n: i for i, n in enumerate(code_graph.vertex_names)}
    edges = {tuple(e) for e in code_graph.edge_index.t().tolist()}

    def linked(u: str, v: str) -> bool:
        return (names[u], names[v]) in edges

    # self.method, same-module names, and a re-export through "from .tasks import *" (asyncio.sleep)
    loop = "asyncio.base_events.BaseEventLoop"
    assert linked(f"{loop}.run_until_complete", f"{loop}.run_forever")
    assert linked(f"{loop}.run_until_complete", "asyncio.tasks.ensure_future")
    assert linked("email.message.Message.get_content_type", "email.message._splitparam")
    assert linked("asyncio.tasks.sleep", "asyncio.events.get_running_loop")


_PACKAGE = {
    "pkg_a/__init__.py": "from .core import *\n",
    "pkg_a/util.py": """
        import sys

        def helper():
            return 1

        def other():
            return helper()

        if sys.platform == "nowhere":
            def plat():
                return helper()
        else:
            def plat():
                return other()
        """,
    "pkg_a/core.py": """
        import os
        from . import util
        from .util import helper as h

        def top():
            return h() + util.other() + os.getcwd()

        class Base:
            def base_method(self):
                return len([])

        class Child(Base):
            def run(self):
                self.base_method()
                self.own()
                return top()

            def own(self):
                def inner():
                    return 1
                return inner()

            @staticmethod
            def st(x):
                return x.own()

        def shadow():
            top = 3
            return top

        alias = top

        def uses_alias():
            return alias()
        """,
    "pkg_b/__init__.py": "",
    "pkg_b/client.py": """
        import pkg_a
        from pkg_a.core import Child

        def go():
            pkg_a.top()
            return Child().run() + pkg_a.core.Child.own(None)
        """,
    "pkg_b/broken.py": "def nope(:\n",
    "test/test_pkg_a.py": """
        def test_x():
            from pkg_a import util
            return util.helper()
        """,
    "test/support.py": "def sup():\n    return 0\n",
}

_EXPECTED_EDGES = {
    ("pkg_a.core.top", "pkg_a.util.helper"), ("pkg_a.core.top", "pkg_a.util.other"),
    ("pkg_a.util.other", "pkg_a.util.helper"),
    ("pkg_a.util.plat", "pkg_a.util.helper"), ("pkg_a.util.plat", "pkg_a.util.other"),   # both branches: one vertex
    ("pkg_a.core.Child", "pkg_a.core.Base"),
    ("pkg_a.core.Child.run", "pkg_a.core.Base.base_method"), ("pkg_a.core.Child.run", "pkg_a.core.Child.own"),
    ("pkg_a.core.Child.run", "pkg_a.core.top"),
    ("pkg_a.core.Child.own", "pkg_a.core.Child.own.<locals>.inner"),
    ("pkg_a.core.uses_alias", "pkg_a.core.top"),
    ("pkg_b.client.go", "pkg_a.core.top"), ("pkg_b.client.go", "pkg_a.core.Child"),
    ("pkg_b.client.go", "pkg_a.core.Child.own"),
    ("test.test_pkg_a.test_x", "pkg_a.util.helper"),
}


def _write_package(root: Path) -> Path:
    for rel, text in _PACKAGE.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip())
    return root


def test_code_graph_resolution_rules_on_a_written_package(tmp_path):
    root = _write_package(tmp_path / "src")
    data = cpython_code_graph(root=root, feature_dim=32, num_classes=2, use_cache=False)
    _check_invariants(data)
    assert data.class_names == ["pkg_a", "pkg_b"]
    assert set(data.vertex_names) == {
        "pkg_a.util.helper", "pkg_a.util.other", "pkg_a.util.plat", "pkg_a.core.top", "pkg_a.core.Base",
        "pkg_a.core.Base.base_method", "pkg_a.core.Child", "pkg_a.core.Child.run", "pkg_a.core.Child.own",
        "pkg_a.core.Child.own.<locals>.inner", "pkg_a.core.Child.st", "pkg_a.core.shadow",
        "pkg_a.core.uses_alias", "pkg_b.client.go", "test.test_pkg_a.test_x",
    }                                   # broken.py skipped, test/support.py has no area
    label = {n: data.class_names[int(y)] for n, y in zip(data.vertex_names, data.y)}
    assert label["test.test_pkg_a.test_x"] == "pkg_a" and label["pkg_b.client.go"] == "pkg_b"
    got = {tuple(sorted((data.vertex_names[s], data.vertex_names[d]))) for s, d in data.edge_index.t().tolist()}
    assert got == {tuple(sorted(e)) for e in _EXPECTED_EDGES}   # st's x.own(), shadow's local "top": dropped


def test_code_graph_file_split_keeps_files_whole(tmp_path):
    root = tmp_path / "src"
    for pkg in ("alpha", "beta"):
        for k in range(10):
            body = "".join(f"def f{j}():\n    return f{(j + 1) % 4}()\n" for j in range(4))
            (root / pkg).mkdir(parents=True, exist_ok=True)
            (root / pkg / f"m{k}.py").write_text(body)
    data = cpython_code_graph(root=root, feature_dim=16, num_classes=2, split="file", train_fraction=0.5,
                              val_fraction=0.2, seed=1, use_cache=False)
    _check_invariants(data)
    split_of = torch.stack([data.train_mask, data.val_mask, data.test_mask]).long().argmax(0)
    for f in range(len(data.files)):
        assert split_of[data.vertex_file == f].unique().numel() == 1          # a file is in one split
    for c in range(2):                                                         # per area 5 / 2 / 3 files
        files = [split_of[data.vertex_file == f][0].item() for f in range(len(data.files))
                 if data.y[data.vertex_file == f][0] == c]
        assert sorted(files) == [0] * 5 + [1] * 2 + [2] * 3


def test_code_graph_cache_is_reused_verified_and_rebuilt(tmp_path, monkeypatch, caplog):
    root = _write_package(tmp_path / "src")
    cache = tmp_path / "cache"
    built = []
    real_build = graphs._build_code_graph

    def counting_build(*args, **kwargs):
        built.append(1)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(graphs, "_build_code_graph", counting_build)
    first = cpython_code_graph(root=root, feature_dim=32, num_classes=2, cache_dir=cache)
    files = list(cache.iterdir())
    assert len(built) == 1 and len(files) == 1 and files[0].name.startswith("code-graph-")   # no temporary left
    again = cpython_code_graph(root=root, feature_dim=32, num_classes=2, cache_dir=cache)
    assert len(built) == 1                                                   # served from the cache
    for f in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(first, f), getattr(again, f))
    assert again.vertex_names == first.vertex_names and again.class_names == first.class_names
    # a torn or foreign file is rebuilt, not trusted
    files[0].write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="tasks.graphs"):
        rebuilt = cpython_code_graph(root=root, feature_dim=32, num_classes=2, cache_dir=cache)
    assert len(built) == 2 and "unreadable cache" in caplog.text
    assert torch.equal(rebuilt.edge_index, first.edge_index)
    # an edited input changes the key: a new build, with the new edge
    (root / "pkg_a" / "util.py").write_text((root / "pkg_a" / "util.py").read_text() + "\ndef extra():\n"
                                            "    return helper()\n")
    edited = cpython_code_graph(root=root, feature_dim=32, num_classes=2, cache_dir=cache)
    assert len(built) == 3 and "pkg_a.util.extra" in edited.vertex_names
    # another argument is another graph
    cpython_code_graph(root=root, feature_dim=64, num_classes=2, cache_dir=cache)
    assert len(built) == 4


def test_code_graph_refuses_bad_arguments(tmp_path):
    root = _write_package(tmp_path / "src")
    with pytest.raises(GraphError, match="fewer than num_classes=5"):
        cpython_code_graph(root=root, num_classes=5, use_cache=False)
    with pytest.raises(GraphError, match="valid: 'random', 'file'"):
        cpython_code_graph(root=root, num_classes=2, split="nodes", use_cache=False)  # type: ignore[arg-type]
    with pytest.raises(GraphError, match="not a folder"):
        cpython_code_graph(root=tmp_path / "missing", use_cache=False)
    with pytest.raises(GraphError, match="feature_dim=0"):
        cpython_code_graph(root=root, feature_dim=0, use_cache=False)
