"""A stage worker's gradient collectives: the data-parallel ``ALLREDUCE`` of a segment (posted
asynchronously, waited at ``OPTIM``) and the tied-weight all-reduce (Megatron-LM's embedding
group). Design: ``docs/runtime-worker.md``, "What a rank does in a step"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from engine.timeline import Event
from runtime.tensor_parallel import local_grad, local_tensor, shard_view
from runtime.worker.errors import WorkerError
from runtime.worker.optimizer import WorkerOptimizer
from runtime.worker.step_state import StepState

__all__ = ["GradientSync", "TiedCopies", "flatten_grads", "unflatten_grads"]


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


class GradientSync:
    """Posts and waits one rank's gradient collectives.

    Args:
        rank: global rank (events); dp: replicas; dp_group: the DP process group (or ``None``).
        opt: the worker's optimizer (AdamA reduces its flat ``[m | v | tied]`` buffers).
        dp_params: segment -> parameters in the DP all-reduce (Adam/SGD; experts excluded).
        tied: the local tied groups.
        device: the worker's device; sync: ``torch.cuda.synchronize`` before a stamp, or ``None``.
        timeout: for waiting collectives.
    """

    def __init__(self, rank: int, dp: int, dp_group: Any, opt: WorkerOptimizer,
                 dp_params: dict[int, list[torch.nn.Parameter]], tied: list[TiedCopies], device: torch.device,
                 sync: Callable[[], None] | None, timeout: timedelta):
        self.rank, self.dp, self.dp_group, self.opt = rank, dp, dp_group, opt
        self.dp_params, self.tied, self.device, self.sync, self.timeout = dp_params, tied, device, sync, timeout
        self.flat_grads: dict[int, torch.Tensor] = {}
        if dp > 1 and not opt.adama:
            for s, ps in dp_params.items():
                n = sum(local_tensor(p).numel() for p in ps)
                if n:
                    self.flat_grads[s] = torch.zeros(n, dtype=torch.float32, device=device)

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
            self._post_flat(flat, s, ev, st)
            return
        flat = self.flat_grads.get(s)
        if flat is None or self.dp_group is None:
            ev.end = start
            return
        flatten_grads(flat, self.dp_params[s], 0)
        self._post_flat(flat, s, ev, st)

    def _post_flat(self, flat: torch.Tensor, s: int, ev: Event, st: StepState) -> None:
        """Post the async SUM all-reduce of ``flat`` over the DP group; :meth:`finish` waits."""
        ev.nbytes = flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
        now = st.now

        def done(_fut: Any, ev: Event = ev) -> None:
            ev.end = now()

        if self.device.type != "cuda":   # NCCL's future completes at launch: stamped when OPTIM has waited it
            try:   # completion time from gloo's callback thread; else the time OPTIM waits for it
                work.get_future().then(done)
            except Exception:
                pass
        st.allreduces.append((work, s, ev))

    def finish(self, st: StepState) -> None:
        """Wait the posted DP all-reduces and write ``sum / dp`` back into ``.grad`` (AdamA:
        ``m``, ``v`` were reduced in place; the tied gradients are copied back)."""
        for work, s, ev in st.allreduces:
            work.wait(self.timeout)
            if ev.end < 0:
                if self.sync is not None:
                    self.sync()
                ev.end = st.now()
            if self.opt.adama:
                unflatten_grads(self.opt.flat_states[s], self.opt.unfolded[s], 2 * self.opt.folded_numel(s))
                continue
            flat = self.flat_grads[s]
            flat.div_(self.dp)
            unflatten_grads(flat, self.dp_params[s], 0)
        st.allreduces.clear()

    # ------------------------------------------------------------- CoCoNet transformations
    # (reached only for plans whose transformations runtime.worker.config.EXECUTED_TRANSFORMS lists)
    def post_reduce_scatter(self, s: int, st: StepState) -> None:
        """``sharded-update``: post segment ``s``'s gradient reduce-scatter. Raises :class:`WorkerError`
        until the runtime executes the transformation."""
        raise WorkerError("the runtime does not execute 'sharded-update' yet")

    def post_all_gather(self, s: int, st: StepState) -> None:
        """``sharded-update``: post the all-gather of segment ``s``'s updated parameter shards. Raises
        :class:`WorkerError` until the runtime executes the transformation."""
        raise WorkerError("the runtime does not execute 'sharded-update' yet")

    def bucket_posted(self, s: int, bucket: int, st: StepState) -> None:
        """``overlap-grad-sync``: the bucket's all-reduce was posted by the backward's hooks. Raises
        :class:`WorkerError` until the runtime executes the transformation."""
        raise WorkerError("the runtime does not execute 'overlap-grad-sync' yet")

    def tied_allreduce(self, st: StepState, ranks: tuple[int, ...] | None) -> None:
        """Sum the tied copies' gradients over their holders (Megatron's embedding all-reduce).

        ``ranks``: from an ``ALLREDUCE`` instruction with ``segment=None``, the pipeline ranks of
        the group it reduces (``()``: every local group); ``None``: at ``OPTIM``, the groups no such
        instruction handled this step. An instruction always yields one event (zero-length when
        nothing here is left to reduce)."""
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
            tc = self.tied[i]
            tc.buf.zero_()
            for p in tc.params:   # a sharded copy adds its shard into its slice: one full gradient per copy
                g = local_grad(p)
                if g is not None:
                    shard_view(tc.buf, p).add_(g)
            buckets.setdefault(id(tc.group), []).append(i)
        for members in buckets.values():
            group = self.tied[members[0]].group
            bufs = [self.tied[i].buf for i in members]
            if group is not None:
                flat = torch.cat([b.reshape(-1) for b in bufs]) if len(bufs) > 1 else bufs[0].reshape(-1)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                if len(bufs) > 1:
                    at = 0
                    for b in bufs:
                        b.copy_(flat[at:at + b.numel()].view_as(b))
                        at += b.numel()
            for i in members:
                for p in self.tied[i].params:
                    set_local_grad(p, shard_view(self.tied[i].buf, p))
            if self.sync is not None:
                self.sync()
            label = self.tied[members[0]].label + (f" (+{len(members) - 1} more)" if len(members) > 1 else "")
            st.events.append(Event(self.rank, "collective", "ALLREDUCE", f"allreduce tied {label}", start,
                                   st.now(), sum(b.numel() * b.element_size() for b in bufs), -1, -1))
            start = st.now()


def flatten_grads(flat: torch.Tensor, params: Sequence[torch.nn.Parameter], offset: int) -> None:
    """Copy each parameter's ``.grad`` (zeros where ``None``) into consecutive slices of ``flat``
    (a tensor-parallel parameter: its local shard, :func:`runtime.tensor_parallel.local_tensor`)."""
    o = offset
    for p in params:
        n = local_tensor(p).numel()
        g = local_grad(p)
        if g is None:
            flat[o:o + n].zero_()
        else:
            flat[o:o + n].copy_(g.reshape(-1))
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
    else:
        from torch.distributed.tensor import DTensor

        d: Any = p
        p.grad = DTensor.from_local(value.clone(), d.device_mesh, d.placements, run_check=False)
