"""A stage worker's gradient collectives: the data-parallel ``ALLREDUCE`` of a segment (posted
asynchronously, waited at ``OPTIM``), the tied-weight all-reduce (Megatron-LM's embedding group)
and CoCoNet's data-parallel transformations (``plan.parallel.transforms``, lowered by
``engine.dependency.lower``). Design: ``docs/runtime-worker.md``, "What a rank does in a step".

``sharded-update`` (CoCoNet section 6.1, ZeRO-1/2): ``REDUCESCATTER`` of a segment lays its
gradients out chunk by chunk (:class:`runtime.worker.optimizer.ShardLayout`: ``[dp, width]``,
row ``d`` = replica ``d``'s ``ceil(numel / dp)`` elements of every parameter), releases them and
posts an async SUM ``reduce_scatter_single`` into the replica's
:class:`~runtime.worker.optimizer.SegmentShard`; ``OPTIM`` waits it (divides by ``dp``), sums the
tied copies' chunks across their holders (chunks of copies are aligned) and updates only that
shard; ``ALLGATHER`` posts an async ``all_gather_single`` of the updated shards, which the step
waits before it returns and writes into the parameters. AdamA reduce-scatters its per-step
``[m | v | tied gradients]`` sums instead; each replica keeps ``m``/``v`` for its chunks only.

``overlap-grad-sync`` (CoCoNet section 4, PyTorch DDP's buckets): the segment's flat gradient
buffer holds its parameters in reverse order and is cut into the byte ranges of
:func:`engine.coconet.gradient_buckets`. While the segment's last backward block of the step
runs (``B``, or ``W``: the compute instruction before its bucketed ``ALLREDUCE`` instructions), a
gradient hook per parameter (``Tensor.register_hook``, which fires for ``torch.autograd.backward``
and for the ``torch.autograd.grad`` of ``W`` alike, before the micro-batch's part is accumulated)
copies the parameter's final gradient (held + this part) into its slot and posts every bucket
whose parameters are all final, in bucket order (the same on every replica); parameters without a
gradient in that block are final at its end. Each bucket is one ``"allreduce s<segment> b<k>"``
event from its post to its completion; ``OPTIM`` waits them all, divides by ``dp`` and writes
``.grad``.

Both together (ZeRO-2 with overlap: the stream's ``REDUCESCATTER`` instructions carry ``bucket``):
the same hooks and buckets, but a bucket reduce-scatters instead of all-reducing: each parameter's
final gradient goes straight into the ``[dp, columns]`` rows of the bucket holding its last element
(:class:`~runtime.worker.optimizer.ShardLayout`'s chunks, so a bucket's parameters are a contiguous
run of the shard's columns), and when the bucket is ready an async ``reduce_scatter_single`` of those
rows lands in the replica's :attr:`SegmentShard.grad` columns (one ``"reducescatter s<segment> b<k>"``
event each); the full gradients are released after the block. ``OPTIM`` then updates the shard and
``ALLGATHER`` follows as without buckets.

Sources: CoCoNet (Jangda et al., "Breaking the Computation and Communication Abstraction Barrier in
Distributed Machine Learning Workloads", ASPLOS 2022): section 6.1 (the all-reduce and Adam update
split into a reduce-scatter, a sharded update and an all-gather) and section 4 (overlapping a
collective with the computation producing its input); ZeRO (Rajbhandari et al., SC 2020, stages 1
and 2); PyTorch DDP's gradient buckets (Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3:
buckets in reverse parameter order, each all-reduced asynchronously as soon as its gradients are
ready, in the same order on every replica).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.coconet import DEFAULT_GRAD_BUCKET_BYTES, gradient_buckets
from engine.dependency import Instruction, Op
from engine.timeline import Event
from runtime.tensor_parallel import local_grad, local_tensor, shard_view
from runtime.worker.errors import WorkerError
from runtime.worker.optimizer import WorkerOptimizer
from runtime.worker.step_state import StepState

__all__ = ["GradientSync", "TiedCopies", "flatten_grads", "transform_refusal", "unflatten_grads", "view_grads"]


@dataclass
class TiedCopies:
    """One tied group as this rank holds it."""

    group: Any
    """Process group over this replica's holders, ``None`` when this rank holds every copy."""
    params: list[torch.nn.Parameter]
    """The local copies."""
    buf: torch.Tensor
    """Pre-allocated sum of the copies' gradients (one copy's full shape; a tensor-parallel copy
    contributes its shard to its slice, :func:`runtime.tensor_parallel.shard_view`)."""
    label: str
    """``"s0:transformer.wte.weight+s3:lm_head.weight"``."""
    pranks: tuple[int, ...]
    """Pipeline ranks holding a copy."""


def transform_refusal(transforms: Sequence[str], *, optimizer: str, dp: int, expert_parallel: bool) -> str | None:
    """Why the worker cannot execute the data-parallel transformations of a plan, in one sentence
    (``None`` when it can): ``overlap-grad-sync`` with AdamA (AdamA reduces ``m`` and ``v`` after
    the step's last fold, not gradients during a backward) and either transformation with
    expert-parallel MoE layers (each replica owns its experts, which are not reduced)."""
    tf = set(transforms) & {"sharded-update", "overlap-grad-sync"}
    if dp < 2 or not tf:
        return None
    if "overlap-grad-sync" in tf and optimizer == "adama":
        return ("the runtime does not execute 'overlap-grad-sync' with optimizer 'adama': AdamA all-reduces its "
                "folded m and v once after the step's last micro-batch, not gradients during a backward; plan "
                "without the transformation or use optimizer 'adam'")
    if expert_parallel:
        return (f"the runtime does not execute {sorted(tf)[0]!r} with expert-parallel MoE layers (each replica owns "
                "its experts, which are not reduced); plan without the transformation")
    return None


@dataclass
class _Buckets:
    """``overlap-grad-sync``: one segment's gradient buckets (PyTorch DDP's ``Reducer``).

    The flat buffer holds the parameters in REVERSE order (``params``; the last parameters'
    gradients are produced first in backward); bucket ``k`` is elements ``bounds[k]`` of it, the
    byte ranges of :func:`engine.coconet.gradient_buckets` over the parameters' bytes (as the
    engine's lowering cut them), rounded up to element boundaries."""

    flat: torch.Tensor
    params: list[torch.nn.Parameter]
    starts: list[int]
    """Element offset of each parameter in ``flat``."""
    bounds: list[tuple[int, int]]
    members: list[list[int]]
    """Per bucket, the parameters (indices into ``params``) with elements in it."""
    of_param: list[list[int]]
    """Per parameter, the buckets it has elements in."""
    final: list[bool] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    next: int = 0
    posted: set[int] = field(default_factory=set)
    repeated: list[int] = field(default_factory=list)
    shard: Any = None
    """ZeRO-2 (reduce-scatter buckets): the segment's :class:`~runtime.worker.optimizer.SegmentShard`;
    ``None`` for all-reduce buckets."""
    post_of: list[int] = field(default_factory=list)
    """ZeRO-2: per parameter, the bucket whose reduce-scatter carries it (the one holding its last element)."""
    cols: list[tuple[int, int]] = field(default_factory=list)
    """ZeRO-2: per bucket, the shard columns of the parameters it carries."""
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    """ZeRO-2: per bucket, the ``[dp, columns]`` reduce-scatter input being filled this step."""

    def reset(self) -> None:
        """Start of a step: nothing final, nothing posted."""
        self.final = [False] * len(self.params)
        self.left = [len(m) for m in self.members]
        self.next = 0
        self.posted = set()
        self.repeated = []
        self.rows = {}


class GradientSync:
    """Posts and waits one rank's gradient collectives.

    Args:
        rank: global rank (events); dp: replicas; dp_group: the DP process group (or ``None``).
        opt: the worker's optimizer (AdamA reduces its flat ``[m | v | tied]`` buffers; with
            ``sharded-update`` its :attr:`~WorkerOptimizer.shards` are what the collectives fill).
        dp_params: segment -> parameters in the DP all-reduce (Adam/SGD; experts excluded).
        tied: the local tied groups.
        device: the worker's device; sync: ``torch.cuda.synchronize`` before a stamp, or ``None``.
        timeout: for waiting collectives.
        stream: this rank's instruction stream; its bucketed ``ALLREDUCE`` instructions
            (``overlap-grad-sync``) say which segments are reduced in buckets and after which
            compute instruction (the segment's last backward block, ``B`` or ``W``).
        bucket_bytes: the plan's ``grad_bucket_bytes`` (``None``: the engine's default).
        local_tied: the tied copies' gradients are summed as this rank's local shards (fully sharded
            data parallelism: the copies' FSDP shards hold the same elements on every holder).

    Raises:
        WorkerError: the stream's buckets of a segment are not the ones its parameters give, or a
            tied group's copies are laid out differently (``sharded-update``).
    """

    def __init__(self, rank: int, dp: int, dp_group: Any, opt: WorkerOptimizer,
                 dp_params: dict[int, list[torch.nn.Parameter]], tied: list[TiedCopies], device: torch.device,
                 sync: Callable[[], None] | None, timeout: timedelta, *, stream: Sequence[Instruction] = (),
                 bucket_bytes: int | None = None, local_tied: bool = False):
        self.rank, self.dp, self.dp_group, self.opt = rank, dp, dp_group, opt
        self.local_tied = local_tied
        self._rs_out: dict[int, torch.Tensor] = {}
        self.dp_params, self.tied, self.device, self.sync, self.timeout = dp_params, tied, device, sync, timeout
        self.flat_grads: dict[int, torch.Tensor] = {}
        self.buckets: dict[int, _Buckets] = {}
        self.arm_at: dict[int, int] = {}
        """``overlap-grad-sync``: stream index of a segment's last backward block -> the segment."""
        self.hooks: list = []
        self._armed: tuple[int, StepState] | None = None
        if dp > 1 and not opt.adama and not opt.sharded:
            for s, ps in dp_params.items():
                n = sum(local_tensor(p).numel() for p in ps)
                if n:
                    self.flat_grads[s] = torch.zeros(n, dtype=torch.float32, device=device)
        if dp > 1 and any(_bucketed(ins) for ins in stream):
            self._build_buckets(stream, bucket_bytes)
            for s in self.buckets:   # a bucketed segment is reduced in its buckets' buffer only
                self.flat_grads.pop(s, None)
        if opt.sharded:
            self._check_tied_shards()

    def buffer_bytes(self) -> int:
        """Bytes of the flat gradient buffers held between steps (the plain all-reduce's and the
        buckets'; the gradients themselves where ``.grad`` is a view into them)."""
        flats = list(self.flat_grads.values()) + [b.flat for b in self.buckets.values()]
        return sum(f.numel() * f.element_size() for f in flats)

    # ------------------------------------------------------------------ the plain data-parallel all-reduce
    def post_allreduce(self, s: int, st: StepState) -> None:
        """``ALLREDUCE`` of segment ``s``: copy its gradients (AdamA: the tied copies' gradients
        after the ``m | v`` views) into the flat buffer and post the SUM all-reduce over the DP
        group (a zero-length event without a DP group or gradients to reduce)."""
        start = st.now()
        ev = Event(self.rank, "collective", "ALLREDUCE", f"allreduce s{s}", start, -1.0, 0, -1, s)
        st.events.append(ev)
        if self.opt.adama:
            flat = self.opt.flat_states.get(s)
            if flat is None or self.dp_group is None:
                ev.end = start
                return
            self.opt.optimizer.begin_step(self.opt.folded[s])   # replica 0: decay what got no gradient
            flatten_grads(flat, self.opt.unfolded[s], 2 * self.opt.folded_numel(s))
            self._post(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True),
                       flat, s, ev, st, "allreduce")
            return
        flat = self.flat_grads.get(s)
        if flat is None or self.dp_group is None:
            ev.end = start
            return
        flatten_grads(flat, self.dp_params[s], 0)
        self._post(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True),
                   flat, s, ev, st, "allreduce")

    def _post(self, work: Any, buf: torch.Tensor, s: int, ev: Event, st: StepState, kind: str) -> None:
        """Track a posted collective on ``buf`` (``kind``: ``"allreduce"``, ``"bucket"``,
        ``"reducescatter"``, ``"allgather"``) until :meth:`finish` waits it; on CPU its event ends
        when gloo reports completion."""
        ev.nbytes = buf.numel() * buf.element_size()
        now = st.now

        def done(_fut: Any, ev: Event = ev) -> None:
            ev.end = now()

        if self.device.type != "cuda":   # NCCL's future completes at launch: stamped when OPTIM has waited it
            try:   # completion time from gloo's callback thread; else the time OPTIM waits for it
                work.get_future().then(done)
            except Exception:
                pass
        st.allreduces.append((work, s, ev, kind, buf))

    def finish(self, st: StepState) -> None:
        """Wait every posted collective, then: a segment's all-reduce (or all its buckets) writes
        ``sum / dp`` back into ``.grad`` (AdamA: ``m``, ``v`` were reduced in place; the tied
        gradients are copied back); a reduce-scatter leaves this replica's chunks in its
        :class:`~runtime.worker.optimizer.SegmentShard` (divided by ``dp``, except AdamA's sums);
        an all-gather writes the updated shards into the parameters."""
        done: dict[int, str] = {}
        for work, s, ev, kind, buf in st.allreduces:
            work.wait(self.timeout)
            if ev.end < 0:
                if self.sync is not None:
                    self.sync()
                ev.end = st.now()
            if kind == "allgather":
                self.opt.shards[s].store_params(buf)
            elif kind == "reducescatter":
                if not self.opt.adama:
                    self.opt.shards[s].grad.div_(self.dp)
            elif kind == "rsbucket":   # ZeRO-2: this bucket's columns of the shard's gradient
                self._rs_out.pop(id(buf)).div_(self.dp)
            else:
                done[s] = kind
        st.allreduces.clear()
        for s, kind in done.items():
            if self.opt.adama:
                unflatten_grads(self.opt.flat_states[s], self.opt.unfolded[s], 2 * self.opt.folded_numel(s))
            elif kind == "bucket":
                b = self.buckets[s]
                b.flat.div_(self.dp)
                unflatten_grads(b.flat, b.params, 0)
            else:
                flat = self.flat_grads[s]
                flat.div_(self.dp)
                unflatten_grads(flat, self.dp_params[s], 0)

    # ------------------------------------------------------------- sharded-update (CoCoNet 6.1, ZeRO-1/2)
    def post_reduce_scatter(self, s: int, st: StepState) -> None:
        """``REDUCESCATTER`` (``sharded-update``) of segment ``s``: lay its gradients (AdamA: the
        per-step ``m``/``v`` sums of the folded parameters, then the tied copies' gradients) out in
        ``[dp, width]`` chunk order (:class:`~runtime.worker.optimizer.ShardLayout`), release the
        full gradients (ZeRO-2; AdamA: the accumulators), and post the async SUM
        ``reduce_scatter_single`` into this replica's :attr:`SegmentShard.grad`."""
        start = st.now()
        ev = Event(self.rank, "collective", "REDUCESCATTER", f"reducescatter s{s}", start, -1.0, 0, -1, s)
        st.events.append(ev)
        sh = self.opt.shards.get(s)
        if sh is None or self.dp_group is None:
            ev.end = start
            return
        rows = torch.empty(self.dp, sh.rs_width, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for i, p in enumerate(sh.params):
                if i < sh.n_folded:   # AdamA: this replica's (1-b1) sum g and (1-b2) sum g**2
                    state = self.opt.accumulator.state[p]
                    sh.layout.put(rows, i, state["exp_avg"].reshape(-1))
                    sh.layout.put(rows, i, state["exp_avg_sq"].reshape(-1), base=sh.folded_width)
                else:
                    g = local_grad(p)
                    sh.layout.put(rows, i, None if g is None else g.reshape(-1), base=sh.folded_width)
                p.grad = None   # the full gradient is not kept past its reduce-scatter
        self.opt.release_accumulators([s])
        work = dist.reduce_scatter_single(sh.grad, rows.view(-1), op=dist.ReduceOp.SUM, group=self.dp_group,
                                          async_op=True)
        self._post(work, rows, s, ev, st, "reducescatter")

    def post_all_gather(self, s: int, st: StepState) -> None:
        """``ALLGATHER`` (``sharded-update``, after ``OPTIM``) of segment ``s``: post the async
        ``all_gather_single`` of every replica's updated parameter shard; :meth:`finish` (at the end
        of the step at the latest) waits it and writes the parameters."""
        start = st.now()
        ev = Event(self.rank, "collective", "ALLGATHER", f"allgather s{s}", start, -1.0, 0, -1, s)
        st.events.append(ev)
        sh = self.opt.shards.get(s)
        if sh is None or self.dp_group is None:
            ev.end = start
            return
        out = torch.empty(self.dp * sh.layout.width, dtype=torch.float32, device=self.device)
        work = dist.all_gather_single(out, sh.param.detach(), group=self.dp_group, async_op=True)
        self._post(work, out, s, ev, st, "allgather")

    def _check_tied_shards(self) -> None:
        """``sharded-update`` reduces tied copies chunk by chunk: every copy of a group must hold the
        same local elements (same numbers, and for a tensor-parallel copy the same slice of the
        full tensor), here and on the other holders (one MAX all-reduce per group). Raises
        :class:`WorkerError`."""
        for tc in self.tied:
            keys = []
            for p in tc.params:
                view = shard_view(tc.buf, p)
                keys.append((local_tensor(p).numel(), view.storage_offset(), tuple(view.shape)))
            if len(set(keys)) > 1:
                raise WorkerError(f"'sharded-update' needs the tied copies {tc.label} to hold the same elements, but "
                                  f"tensor parallelism shards them differently here ({keys}); plan without it")
            if tc.group is None or not keys:
                continue
            n, off, _ = keys[0]
            t = torch.tensor([n, off, -n, -off], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tc.group)
            if t.tolist() != [n, off, -n, -off]:
                raise WorkerError(f"'sharded-update' needs the tied copies {tc.label} to hold the same elements on "
                                  "every holder, but tensor parallelism shards them differently; plan without it")

    # --------------------------------------------------------- overlap-grad-sync (CoCoNet 4, DDP's buckets)
    def _build_buckets(self, stream: Sequence[Instruction], bucket_bytes: int | None) -> None:
        """Cut each bucketed segment's flat gradient buffer like the engine's lowering, find its last
        backward block in ``stream`` and register the gradient hooks."""
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        for idx, ins in enumerate(stream):
            if _bucketed(ins) and ins.segment is not None:
                counts[ins.segment] = counts.get(ins.segment, 0) + 1
                first.setdefault(ins.segment, idx)
        for s, n_buckets in counts.items():
            shard = self.opt.shards.get(s) if self.opt.sharded else None
            own = shard.params if shard is not None else ([] if self.opt.sharded else self.dp_params.get(s, []))
            params = list(reversed(own))
            nbytes = [local_tensor(p).numel() * p.element_size() for p in params]
            sizes = gradient_buckets(sum(nbytes), bucket_bytes or DEFAULT_GRAD_BUCKET_BYTES)
            if len(sizes) != n_buckets:
                raise WorkerError(f"the stream reduces segment {s}'s gradients in {n_buckets} buckets, but its "
                                  f"{sum(nbytes)} gradient bytes make {len(sizes)}; re-plan with this model")
            starts, bounds = _cut(params, sizes)
            numels = [local_tensor(p).numel() for p in params]
            members = [[i for i in range(len(params)) if starts[i] < e1 and e0 < starts[i] + numels[i]]
                       for e0, e1 in bounds]
            of_param = [[k for k, m in enumerate(members) if i in m] for i in range(len(params))]
            # ZeRO-2 holds no flat gradient buffer: each bucket's reduce-scatter rows are filled directly
            flat = torch.zeros(0 if self.opt.sharded else sum(numels), dtype=torch.float32, device=self.device)
            self.buckets[s] = _Buckets(flat, params, starts, bounds, members, of_param)
            if shard is not None:
                self._shard_buckets(self.buckets[s], shard)
            self.buckets[s].reset()
            blocks = [(i, stream[i].block) for i in range(first[s] - 1, -1, -1) if stream[i].op in (Op.B, Op.W)]
            last = next((i for i, blk in blocks if blk is not None and blk.segment == s), None)
            if last is None:
                raise WorkerError(f"the stream reduces segment {s}'s gradient buckets without a backward of it before")
            self.arm_at[last] = s
            for i, p in enumerate(params):
                self.hooks.append(p.register_hook(self._hook(s, i)))

    @staticmethod
    def _shard_buckets(b: _Buckets, shard: Any) -> None:
        """ZeRO-2: which bucket's reduce-scatter carries each parameter (the bucket of its last
        element) and the shard columns each bucket covers; ``b.params`` are ``shard.params`` reversed,
        so a bucket's parameters are a contiguous run of the shard layout's columns."""
        n, lay = len(b.params), shard.layout
        b.shard = shard
        b.post_of = [max(b.of_param[i], default=0) for i in range(n)]
        b.cols = []
        for k in range(len(b.bounds)):
            fwd = [n - 1 - i for i in range(n) if b.post_of[i] == k]   # forward (layout) indices
            if fwd:
                lo, hi = min(fwd), max(fwd)
                b.cols.append((lay.offsets[lo], lay.offsets[hi] + lay.chunks[hi]))
            else:
                b.cols.append((0, 0))

    def _hook(self, s: int, i: int) -> Callable[[torch.Tensor], None]:
        """The gradient hook of parameter ``i`` of segment ``s``'s buckets: while that segment's last
        backward block runs, its gradient is final once this micro-batch's part arrives."""
        def hook(g: torch.Tensor) -> None:
            armed = self._armed
            if armed is not None and armed[0] == s:
                self._param_final(s, i, g, armed[1])
        return hook

    @torch.no_grad()
    def _param_final(self, s: int, i: int, g: torch.Tensor | None, st: StepState) -> None:
        """Copy parameter ``i``'s final gradient (what it holds plus ``g``, this micro-batch's part
        about to be accumulated; ``None``: what it holds) into its slot, then post every bucket
        whose parameters are all final, in bucket order."""
        b = self.buckets[s]
        if b.final[i]:
            b.repeated.append(i)
            return
        p: Any = b.params[i]
        held: Any = p.grad
        total: Any = held if g is None else (g if held is None else held + g)
        if total is not None and local_tensor(p) is not p and tuple(total.placements) != tuple(p.placements):
            total = total.redistribute(p.device_mesh, p.placements)   # DTensor, as local_grad
        if b.shard is not None:   # ZeRO-2: into the [dp, columns] rows of the bucket that carries it
            k = b.post_of[i]
            c0, c1 = b.cols[k]
            rows = b.rows.get(k)
            if rows is None:
                rows = b.rows[k] = torch.zeros(self.dp, c1 - c0, dtype=torch.float32, device=self.device)
            flat = None if total is None else local_tensor(total).reshape(-1)
            b.shard.layout.put(rows, len(b.params) - 1 - i, flat, base=-c0)
        else:
            n = local_tensor(p).numel()
            slot = b.flat[b.starts[i]:b.starts[i] + n]
            if total is None:
                slot.zero_()
            else:
                slot.copy_(local_tensor(total).reshape(-1))
        b.final[i] = True
        for k in b.of_param[i]:
            b.left[k] -= 1
        while b.next < len(b.bounds) and b.left[b.next] == 0:
            self._post_bucket(s, b.next, st)
            b.next += 1

    def _post_bucket(self, s: int, k: int, st: StepState) -> None:
        """Post bucket ``k`` of segment ``s``: an async SUM all-reduce of its slice of the flat buffer,
        with its own ``"allreduce s<s> b<k>"`` event starting now."""
        b = self.buckets[s]
        e0, e1 = b.bounds[k]
        start = st.now()
        if b.shard is not None:
            self._post_shard_bucket(s, k, st)
            return
        ev = Event(self.rank, "collective", "ALLREDUCE", f"allreduce s{s} b{k}", start, -1.0, 0, -1, s)
        st.events.append(ev)
        b.posted.add(k)
        if e1 == e0 or self.dp_group is None:
            ev.end = start
            return
        part = b.flat[e0:e1]
        self._post(dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True),
                   part, s, ev, st, "bucket")

    def _post_shard_bucket(self, s: int, k: int, st: StepState) -> None:
        """ZeRO-2: post bucket ``k`` of segment ``s`` as an async SUM ``reduce_scatter_single`` of its
        ``[dp, columns]`` rows into this replica's columns of :attr:`SegmentShard.grad`, with its own
        ``"reducescatter s<s> b<k>"`` event (zero-length when the bucket carries no parameter)."""
        b = self.buckets[s]
        start = st.now()
        ev = Event(self.rank, "collective", "REDUCESCATTER", f"reducescatter s{s} b{k}", start, -1.0, 0, -1, s)
        st.events.append(ev)
        b.posted.add(k)
        c0, c1 = b.cols[k]
        rows = b.rows.pop(k, None)
        if c1 == c0 or rows is None or self.dp_group is None:
            ev.end = start
            return
        out = b.shard.grad[b.shard.folded_width + c0:b.shard.folded_width + c1]
        self._rs_out[id(rows)] = out
        work = dist.reduce_scatter_single(out, rows.view(-1), op=dist.ReduceOp.SUM, group=self.dp_group,
                                          async_op=True)
        self._post(work, rows, s, ev, st, "rsbucket")

    def begin_step(self) -> None:
        """At the start of a step: no bucket posted, no segment's backward watched; every plain
        (not tensor-parallel, float32) parameter's ``.grad`` is its zeroed slice of the segment's
        flat all-reduce buffer (PyTorch DDP's ``gradient_as_bucket_view``), so the backward
        accumulates into the buffer and the gradients are held once, not twice."""
        self._armed = None
        for b in self.buckets.values():
            b.reset()
        for s, flat in self.flat_grads.items():
            flat.zero_()
            view_grads(flat, self.dp_params[s])

    def before_instruction(self, idx: int, st: StepState) -> None:
        """Before stream instruction ``idx``: a segment's last backward block arms its hooks."""
        s = self.arm_at.get(idx)
        if s is not None:
            self.buckets[s].reset()
            self._armed = (s, st)

    def after_instruction(self, idx: int, st: StepState) -> None:
        """After stream instruction ``idx``: once a segment's last backward block has run, the
        parameters whose hook did not fire (no gradient in that block) are final as they are and
        the remaining buckets are posted. Raises :class:`WorkerError` when a parameter got two
        gradients in the block (its bucket may have left before the second)."""
        s = self.arm_at.get(idx)
        if s is None:
            return
        self._armed = None
        b = self.buckets[s]
        for i in range(len(b.params)):
            if not b.final[i]:
                self._param_final(s, i, None, st)
        if b.shard is not None:   # ZeRO-2: the full gradients are not kept past their reduce-scatter
            for p in b.params:
                p.grad = None
        if b.repeated:
            raise WorkerError(f"'overlap-grad-sync': parameter(s) {sorted(set(b.repeated))} of segment {s} received "
                              "two gradients in its last backward block, after their bucket could have been posted; "
                              "plan without the transformation")

    def bucket_posted(self, s: int, bucket: int, st: StepState) -> None:
        """``ALLREDUCE`` of a gradient bucket (``overlap-grad-sync``): the segment's last backward
        posted it (its hooks, or the end of the block). Raises :class:`WorkerError` naming the
        segment and the bucket when it was not."""
        b = self.buckets.get(s)
        if b is None or bucket not in b.posted:
            raise WorkerError(f"gradient bucket {bucket} of segment {s} was not posted by the segment's last backward "
                              "block")

    def remove_hooks(self) -> None:
        """Remove the gradient-bucket hooks (idempotent)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    # ------------------------------------------------------------------ tied weights
    def tied_allreduce(self, st: StepState, ranks: tuple[int, ...] | None) -> None:
        """Sum the tied copies' gradients over their holders (Megatron's embedding all-reduce).

        ``ranks``: from an ``ALLREDUCE`` instruction with ``segment=None``, the pipeline ranks of
        the group it reduces (``()``: every local group); ``None``: at ``OPTIM``, the groups no such
        instruction handled this step. An instruction always yields one event (zero-length when
        nothing here is left to reduce). With ``sharded-update`` only this replica's chunks of the
        copies' reduce-scattered gradients are summed (the copies' chunks are aligned,
        :class:`~runtime.worker.optimizer.ShardLayout`)."""
        todo = [i for i in range(len(self.tied)) if i not in st.tied_done
                and (not ranks or tuple(sorted(ranks)) == self.tied[i].pranks)]
        if ranks is not None and not todo:
            t = st.now()
            st.events.append(Event(self.rank, "collective", "ALLREDUCE", "allreduce tied", t, t, 0, -1, -1))
            return
        start = st.now()
        buckets: dict[int, list[int]] = {}   # one all-reduce per process group, every group of its holders
        for i in todo:
            st.tied_done.add(i)
            buckets.setdefault(id(self.tied[i].group), []).append(i)
        for members in buckets.values():
            group = self.tied[members[0]].group
            bufs = [self._tied_sum(self.tied[i]) for i in members]
            if group is not None:
                flat = torch.cat([b.reshape(-1) for b in bufs]) if len(bufs) > 1 else bufs[0].reshape(-1)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                if len(bufs) > 1:
                    at = 0
                    for b in bufs:
                        b.copy_(flat[at:at + b.numel()].view_as(b))
                        at += b.numel()
            for i, buf in zip(members, bufs):
                for p in self.tied[i].params:
                    if self.opt.sharded:
                        self.opt.grad_chunk(p).copy_(buf)
                    elif self.local_tied:
                        set_local_grad(p, buf)
                    else:
                        set_local_grad(p, shard_view(buf, p))
            if self.sync is not None:
                self.sync()
            label = self.tied[members[0]].label + (f" (+{len(members) - 1} more)" if len(members) > 1 else "")
            st.events.append(Event(self.rank, "collective", "ALLREDUCE", f"allreduce tied {label}", start,
                                   st.now(), sum(b.numel() * b.element_size() for b in bufs), -1, -1))
            start = st.now()

    def _tied_sum(self, tc: TiedCopies) -> torch.Tensor:
        """The sum of the local copies' gradients: the full tensor (``tc.buf``, a tensor-parallel copy
        adds its shard into its slice) or, sharded, this replica's chunk (a new tensor)."""
        if self.opt.sharded or self.local_tied:
            if self.opt.sharded:
                chunks = [self.opt.grad_chunk(p) for p in tc.params]
            else:   # FSDP: each copy's local shard of its reduce-scattered gradient, the same elements
                chunks = [g if (g := local_grad(p)) is not None else torch.zeros_like(local_tensor(p))
                          for p in tc.params]
            total = chunks[0].clone()
            for c in chunks[1:]:
                total.add_(c)
            return total
        tc.buf.zero_()
        for p in tc.params:   # a sharded copy adds its shard into its slice: one full gradient per copy
            g = local_grad(p)
            if g is not None:
                shard_view(tc.buf, p).add_(g)
        return tc.buf


def _bucketed(ins: Instruction) -> bool:
    """A gradient bucket's collective (``overlap-grad-sync``): an ``ALLREDUCE``, or with
    ``sharded-update`` a ``REDUCESCATTER``, carrying ``bucket`` (not an FSDP unit's, ``block`` set)."""
    return ins.op in (Op.ALLREDUCE, Op.REDUCESCATTER) and ins.bucket is not None and ins.block is None \
        and ins.segment is not None


def _cut(params: Sequence[torch.Tensor], sizes: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Element offsets of ``params`` (local shards) laid out one after the other in a flat fp32
    buffer, and the element range of each byte range ``sizes`` (consecutive, over the parameters'
    own bytes: ``numel * element_size``, as the engine counts them), a boundary inside an element
    rounded up to the next one."""
    starts, byte_starts, at, bat = [], [], 0, 0
    for p in params:
        starts.append(at)
        byte_starts.append(bat)
        at += local_tensor(p).numel()
        bat += local_tensor(p).numel() * p.element_size()

    def elem(b: int) -> int:   # the first element at or after byte b
        for i, p in enumerate(params):
            es = p.element_size()
            if byte_starts[i] <= b < byte_starts[i] + local_tensor(p).numel() * es:
                return starts[i] + -(-(b - byte_starts[i]) // es)
        return at

    bounds, cum = [], 0
    for size in sizes:
        bounds.append((elem(cum), elem(cum + size)))
        cum += size
    return starts, bounds


def flatten_grads(flat: torch.Tensor, params: Sequence[torch.nn.Parameter], offset: int) -> None:
    """Copy each parameter's ``.grad`` (zeros where ``None``) into consecutive slices of ``flat``
    (a tensor-parallel parameter: its local shard, :func:`runtime.tensor_parallel.local_tensor`)."""
    o = offset
    for p in params:
        n = local_tensor(p).numel()
        g = local_grad(p)
        if g is None:
            flat[o:o + n].zero_()
        elif g.data_ptr() != flat[o:o + n].data_ptr():   # not already its slice (view_grads)
            flat[o:o + n].copy_(g.reshape(-1))
        o += n


def view_grads(flat: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> None:
    """Make each parameter's ``.grad`` its slice of ``flat`` (``flatten_grads``' layout from
    offset 0), where the slice can be one: a plain tensor (not a DTensor shard) of ``flat``'s dtype
    and device. The others keep their own ``.grad``, which ``flatten_grads`` copies in."""
    o = 0
    for p in params:
        lp = local_tensor(p)
        n = lp.numel()
        if lp is p and p.dtype == flat.dtype and p.device == flat.device:
            p.grad = flat[o:o + n].view_as(p)
        o += n


def unflatten_grads(flat: torch.Tensor, params: Sequence[torch.nn.Parameter], offset: int) -> None:
    """Write consecutive slices of ``flat`` (from ``offset``) into each parameter's ``.grad`` (its
    local shard for a tensor-parallel parameter)."""
    o = offset
    for p in params:
        lp = local_tensor(p)
        n = lp.numel()
        set_local_grad(p, flat[o:o + n].view_as(lp))
        o += n


def set_local_grad(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set ``p.grad`` (its local shard, for a DTensor ``p``) to a copy of ``value``."""
    g = local_grad(p)
    if g is not None:
        g.copy_(value)
        return
    if local_tensor(p) is p:
        p.grad = value.clone()
    else:   # the global shape given: FSDP's dim-0 shards may be uneven
        d: Any = p
        p.grad = DTensor.from_local(value.clone(), d.device_mesh, d.placements, run_check=False, shape=d.shape,
                                    stride=d.stride())
