"""A stage worker's optimizer: construction (Adam, SGD, AdamA with per-parameter folding hooks),
AdamA's data-parallel replica logic (flat ``[m | v | tied gradients]`` buffers, owner replica),
CoCoNet's sharded update (each replica updates only its ``1/dp`` shard: :class:`ShardLayout`,
:class:`SegmentShard`) and the optimizer's checkpoint state (``docs/runtime-worker.md``,
"Optimizers and AdamA"; the collectives: :mod:`runtime.worker.grad_sync`).

Sharded update (``sharded-update``; CoCoNet, Jangda et al., ASPLOS 2022, section 6.1, its Adam
example; ZeRO stages 1 and 2, Rajbhandari et al., SC 2020): the optimizer's parameters are not the
model's but one flat fp32 tensor per segment holding this replica's chunks of the segment's
parameters (:attr:`SegmentShard.param`), so Adam's ``m`` and ``v`` exist for ``1/dp`` of the
elements only. Adam is elementwise, so updating the chunks equals updating the whole parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor

from runtime.adama import AdamA
from runtime.tensor_parallel import local_grad, local_tensor
from runtime.worker.device import cpu_copy
from runtime.worker.errors import WorkerError

__all__ = ["SegmentShard", "ShardLayout", "WorkerOptimizer", "adam", "fused_adam"]

#: dtypes ``torch.optim.Adam(fused=True)`` updates on CPU and CUDA
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fused_adam(tp: int, dp_shard: int = 1) -> bool:
    """Whether a plan's Adam is fused: without tensor parallelism and fully sharded data parallelism
    (``tp == 1`` and ``dp_shard == 1``: every parameter a plain tensor, not a ``DTensor``), so
    :class:`WorkerOptimizer` and the single-process reference (:func:`runtime.reference.reference_run`)
    update with the same arithmetic."""
    return int(tp) == 1 and int(dp_shard) == 1


def adam(params: Sequence[torch.nn.Parameter], lr: float, *, fused: bool = True) -> torch.optim.Adam:
    """``torch.optim.Adam`` with its defaults; with ``fused`` (``fused=True``: one kernel per dtype
    and device, as Megatron-LM's and torchtitan's Adam) where every parameter is a plain CPU or
    CUDA tensor of a float dtype, the default implementation otherwise (tensor-parallel DTensor
    parameters, which the fused kernel does not take).

    Fused, the update allocates no temporaries: the default on CPU (the per-parameter loop) holds
    two tensors the size of the parameter while it computes ``sqrt(v) / bias_correction + eps``, a
    transient the plan's memory model does not count (130 MB on a rank with a 32,000 x 512
    embedding), and it is several times slower on CPU (0.19 s against 0.02 s for 33M parameters
    here). The two agree to float rounding (2.4e-7 in that check), which Adam's division by the
    gradient's RMS can turn into visible differences on near-zero gradients; so the reference
    uses the same choice (:func:`fused_adam`). Source: PyTorch ``torch.optim.Adam`` documentation
    (``fused``).
    """
    ps = list(params)
    fused = fused and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                          and p.dtype in _FUSED_DTYPES for p in ps)
    return torch.optim.Adam(ps, lr=lr, fused=True) if fused else torch.optim.Adam(ps, lr=lr)


class ShardLayout:
    """How ``dp`` replicas split a list of tensors, chunk by chunk (ZeRO's partitioning, per tensor).

    Tensor ``i`` (``numels[i]`` elements, flattened in row-major order) is cut into ``dp`` chunks of
    ``chunks[i] = ceil(numels[i] / dp)`` elements, the last ones padded with zeros. Replica ``d``
    owns chunk ``d`` of every tensor, at columns ``offsets[i] .. offsets[i] + chunks[i]`` of its
    shard (``width`` elements in all). A full buffer is a ``[dp, width]`` matrix whose row ``d`` is
    replica ``d``'s shard: what ``reduce_scatter_single`` splits and ``all_gather_single`` assembles.
    Chunking each tensor (rather than their concatenation) keeps the chunks of tied copies (same
    shape, other segments or pipeline ranks) aligned, so the tied all-reduce runs on the shards.

    Args:
        numels: elements of each tensor (a tensor-parallel parameter: its local shard).
        dp: replicas.
    """

    def __init__(self, numels: Sequence[int], dp: int):
        self.dp = int(dp)
        self.numels = [int(n) for n in numels]
        self.chunks = [-(-n // self.dp) for n in self.numels]
        self.offsets: list[int] = []
        at = 0
        for c in self.chunks:
            self.offsets.append(at)
            at += c
        self.width = at
        """Elements of one replica's shard."""

    def put(self, rows: torch.Tensor, i: int, flat: torch.Tensor | None, base: int = 0) -> None:
        """Write tensor ``i``'s values ``flat`` (``numels[i]`` elements; ``None``: zeros) into its
        columns ``base + offsets[i] ..`` of ``rows`` (``[dp, ...]``), chunk ``d`` into row ``d``,
        padding with zeros."""
        n, c, o = self.numels[i], self.chunks[i], base + self.offsets[i]
        dst = rows[:, o:o + c]
        if flat is None or n == 0:
            dst.zero_()
        elif n == self.dp * c:
            dst.copy_(flat.reshape(self.dp, c))
        else:
            padded = flat.new_zeros(self.dp * c)
            padded[:n] = flat.reshape(-1)
            dst.copy_(padded.view(self.dp, c))

    def get(self, rows: torch.Tensor, i: int, base: int = 0) -> torch.Tensor:
        """Tensor ``i``'s ``numels[i]`` values (flat, a new tensor) from its columns of ``rows``."""
        n, c, o = self.numels[i], self.chunks[i], base + self.offsets[i]
        return rows[:, o:o + c].reshape(-1)[:n]

    def load_chunks(self, shard: torch.Tensor, i: int, flat: torch.Tensor, d: int) -> None:
        """Copy chunk ``d`` of tensor ``i``'s values ``flat`` into its columns of the ``width``-long
        ``shard`` (padding with zeros)."""
        n, c, o = self.numels[i], self.chunks[i], self.offsets[i]
        lo, hi = min(d * c, n), min((d + 1) * c, n)
        shard[o:o + hi - lo].copy_(flat.reshape(-1)[lo:hi])
        shard[o + hi - lo:o + c].zero_()


@dataclass
class SegmentShard:
    """One segment's sharded optimizer state on this replica (``sharded-update``).

    The reduce-scatter's per-replica row has ``folded_width + layout.width`` columns:
    ``[0, folded_width)`` the first moments ``m`` of the first ``n_folded`` parameters (AdamA's
    per-step sums ``(1-b1) * sum g``), then at ``folded_width + offsets[i]`` tensor ``i``'s second
    moment ``v`` (AdamA, ``i < n_folded``) or its gradient (every other parameter; Adam and SGD:
    all of them, ``n_folded = 0``).
    """

    params: list[torch.nn.Parameter]
    """The segment's parameters in layout order (AdamA: folded ones, then the tied copies)."""
    layout: ShardLayout
    """Over the parameters' local numbers of elements."""
    n_folded: int
    """AdamA: how many leading parameters reduce ``m`` and ``v`` (0 for Adam and SGD)."""
    folded_width: int
    """Columns of the folded parameters' chunks (``sum(layout.chunks[:n_folded])``)."""
    param: torch.nn.Parameter
    """``[layout.width]`` fp32: this replica's chunks of the parameters, the optimizer's parameter."""
    grad: torch.Tensor
    """``[folded_width + layout.width]`` fp32: what the reduce-scatter writes (see the class docstring)."""

    @property
    def rs_width(self) -> int:
        """Columns of one replica's row of the reduce-scatter input (``grad``'s length)."""
        return self.folded_width + self.layout.width

    def grad_chunk(self, i: int) -> torch.Tensor:
        """The view of ``grad`` holding tensor ``i``'s gradient chunk (``i >= n_folded``)."""
        o = self.folded_width + self.layout.offsets[i]
        return self.grad[o:o + self.layout.chunks[i]]

    @torch.no_grad()
    def load_params(self, d: int) -> None:
        """Refresh :attr:`param` with chunk ``d`` of every parameter (their current values)."""
        for i, p in enumerate(self.params):
            self.layout.load_chunks(self.param.data, i, local_tensor(p).detach(), d)

    @torch.no_grad()
    def store_params(self, gathered: torch.Tensor) -> None:
        """Write the all-gathered ``[dp * layout.width]`` shards back into the parameters (their
        local shards for tensor-parallel ones)."""
        rows = gathered.view(self.layout.dp, self.layout.width)
        for i, p in enumerate(self.params):
            lp = local_tensor(p)
            lp.copy_(self.layout.get(rows, i).view_as(lp))


class WorkerOptimizer:
    """The optimizer over this rank's segments' parameters.

    Args:
        name: ``"adam"``, ``"sgd"`` or ``"adama"`` (checked by the caller).
        lr: learning rate.
        seg_params: segment -> its parameters (this rank's segments, in order).
        tied_ids: ``id()`` of the pipeline-tied copies (AdamA does not fold them per micro-batch).
        dp: replicas; with AdamA and ``dp > 1`` the flat all-reduce buffers are allocated.
        device: where the flat buffers live.
        sharded: CoCoNet's ``sharded-update`` (with ``dp > 1``): the optimizer keeps states only for
            this replica's ``1/dp`` chunks of the parameters (:attr:`shards`).
        shard_index: this replica's rank in its data-parallel group (the chunks it owns).
        fused: Adam fused where its parameters allow (:func:`adam`, :func:`fused_adam`).

    Attributes:
        optimizer: the ``torch.optim`` optimizer, ``None`` without parameters (sharded: over the
            segments' flat parameter shards, :attr:`SegmentShard.param`).
        adama: the optimizer is AdamA.
        dp: replicas.
        sharded: the sharded update is on (``dp > 1``).
        folded, unfolded: AdamA: segment -> parameters folded per micro-batch / tied copies folded
            once per step (empty otherwise).
        flat_states: AdamA with ``dp > 1`` (not sharded): segment -> flat ``[m | v | tied gradients]`` buffer.
        shards: sharded: segment -> :class:`SegmentShard`.
        accumulator: sharded AdamA: an :class:`~runtime.adama.AdamA` over the folded parameters that
            only folds: its ``m``/``v`` are per-step sums ``(1-b1) sum g``, ``(1-b2) sum g**2``,
            allocated at the step's start and released once reduce-scattered.
        fold_hooks: the folding hooks' handles.
        scaler: ``16-mixed``'s dynamic loss scaler (:class:`runtime.precision.LossScaler`, set by the
            worker after construction), or ``None``: :meth:`scale_loss` multiplies every micro-batch
            loss by its scale and :meth:`step` unscales, skips a step with inf/nan gradients on any
            rank, and updates the scale.
    """

    def __init__(self, name: str, lr: float, seg_params: dict[int, list[torch.nn.Parameter]], tied_ids: set[int],
                 dp: int, device: torch.device, *, sharded: bool = False, shard_index: int = 0,
                 fused: bool = True):
        self.adama = name == "adama"
        self.fused = fused
        self.dp = dp
        self.sharded = bool(sharded) and dp > 1
        self.shard_index = int(shard_index)
        self._shards_stale = False   # sharded update: parameters changed outside OPTIM (a loaded checkpoint)
        self.device = device
        self.folded: dict[int, list] = {s: [] for s in seg_params}
        self.unfolded: dict[int, list] = {s: [] for s in seg_params}
        self.flat_states: dict[int, torch.Tensor] = {}
        self.shards: dict[int, SegmentShard] = {}
        self.accumulator: Any = None
        self._chunk_of: dict[int, tuple[int, int]] = {}
        self.fold_hooks: list = []
        self.optimizer: Any = None
        self.scaler: Any = None
        self.params = [p for ps in seg_params.values() for p in ps]
        if not self.params:
            return
        if self.sharded:
            self._build_sharded(name, lr, seg_params, tied_ids, device)
            return
        if name == "adam":
            self.optimizer = adam(self.params, lr, fused=self.fused)
            return
        if name == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=lr)
            return
        self._build_adama(lr, seg_params, tied_ids, dp, device)

    def _split_folded(self, seg_params: dict[int, list[torch.nn.Parameter]], tied_ids: set[int]) -> None:
        for s, ps in seg_params.items():
            for p in ps:
                (self.unfolded if id(p) in tied_ids else self.folded)[s].append(p)

    def _build_adama(self, lr: float, seg_params: dict[int, list[torch.nn.Parameter]], tied_ids: set[int], dp: int,
                     device: torch.device) -> None:
        self._split_folded(seg_params, tied_ids)
        folded = [p for s in seg_params for p in self.folded[s]]
        unfolded = [p for s in seg_params for p in self.unfolded[s]]
        groups = [{"params": ps} for ps in (folded, unfolded) if ps]
        # fold=False: AdamA's flag is per optimizer; the folded group gets the worker's hooks below
        opt = self.optimizer = AdamA(groups, lr=lr, fold=False)
        for p in folded:
            self.fold_hooks.append(p.register_post_accumulate_grad_hook(lambda q: opt.fold([q])))
        if dp > 1:
            for s in seg_params:
                n = sum(p.numel() for p in self.folded[s])
                t = sum(p.numel() for p in self.unfolded[s])
                if n + t:
                    self.flat_states[s] = torch.zeros(2 * n + t, dtype=torch.float32, device=device)
            self.bind_flat_states()

    def _build_sharded(self, name: str, lr: float, seg_params: dict[int, list[torch.nn.Parameter]],
                       tied_ids: set[int], device: torch.device) -> None:
        """``sharded-update``: one :class:`SegmentShard` per segment and the optimizer over their flat
        parameter shards; AdamA also gets its per-step :attr:`accumulator`. Raises
        :class:`WorkerError` for non-float32 parameters."""
        for p in self.params:
            if p.dtype != torch.float32:
                raise WorkerError(f"'sharded-update' keeps float32 parameter shards; a parameter of shape "
                                  f"{tuple(p.shape)} is {p.dtype}: plan without the transformation")
        if self.adama:
            self._split_folded(seg_params, tied_ids)
        for s, ps in seg_params.items():
            order = self.folded[s] + self.unfolded[s] if self.adama else list(ps)
            n_folded = len(self.folded[s]) if self.adama else 0
            layout = ShardLayout([local_tensor(p).numel() for p in order], self.dp)
            if layout.width == 0:
                continue
            fw = sum(layout.chunks[:n_folded])
            param = torch.nn.Parameter(torch.zeros(layout.width, dtype=torch.float32, device=device))
            sh = SegmentShard(order, layout, n_folded, fw, param,
                              torch.zeros(fw + layout.width, dtype=torch.float32, device=device))
            sh.load_params(self.shard_index)
            self.shards[s] = sh
            for i, p in enumerate(order):
                self._chunk_of[id(p)] = (s, i)
        shard_params = [sh.param for sh in self.shards.values()]
        if not shard_params:
            return
        if name == "adam":
            self.optimizer = adam(shard_params, lr, fused=self.fused)
        elif name == "sgd":
            self.optimizer = torch.optim.SGD(shard_params, lr=lr)
        else:
            self.optimizer = AdamA(shard_params, lr=lr, fold=False)
            folded = [p for s in seg_params for p in self.folded[s]]
            if folded:
                acc = self.accumulator = AdamA(folded, lr=lr, fold=False)
                for p in folded:
                    self.fold_hooks.append(p.register_post_accumulate_grad_hook(lambda q: acc.fold([q])))
                self.release_accumulators(list(self.folded))

    def folded_numel(self, s: int) -> int:
        """Elements of segment ``s``'s folded parameters (the ``m`` part of its flat buffer)."""
        return sum(p.numel() for p in self.folded[s])

    def bind_flat_states(self) -> None:
        """Make every folded parameter's ``m``/``v`` a view into its segment's flat buffer (values
        kept), so the data-parallel all-reduce runs in place. Raises :class:`WorkerError` for
        non-float32 parameters."""
        for s, flat in self.flat_states.items():
            n = self.folded_numel(s)
            o = 0
            for p in self.folded[s]:
                k = p.numel()
                st = self.optimizer.state[p]
                if p.dtype != flat.dtype:
                    raise WorkerError(f"AdamA data parallelism needs float32 parameters; {tuple(p.shape)} is {p.dtype}")
                for key, at in (("exp_avg", o), ("exp_avg_sq", n + o)):
                    view = flat[at:at + k].view_as(p)
                    if st[key].data_ptr() != view.data_ptr():
                        view.copy_(st[key])
                        st[key] = view
                o += k

    def begin_replica_step(self, dp_index: int) -> None:
        """At the start of a step. AdamA data parallelism, replicas ``dp_index > 0``: zero
        ``m``/``v`` of the folded parameters and mark them not fresh (replica 0 alone carries
        ``b1*m``/``b2*v``; the SUM all-reduce adds the replicas' folded gradients to it). Edits
        ``optimizer.state`` directly. Sharded AdamA, every replica: allocate the
        :attr:`accumulator`'s zero ``m``/``v`` (not fresh: the owner of each chunk decays its
        persistent states at ``OPTIM``). A no-op otherwise (not AdamA, ``dp == 1``, replica 0, or
        no parameters)."""
        if not self.adama or self.dp <= 1 or self.optimizer is None:
            return
        if self.sharded:
            if self.accumulator is not None:
                for ps in self.folded.values():
                    for p in ps:
                        st = self.accumulator.state[p]
                        st["exp_avg"] = torch.zeros_like(p)
                        st["exp_avg_sq"] = torch.zeros_like(p)
                        st["fresh"] = False
            return
        if dp_index == 0:
            return
        for ps in self.folded.values():
            for p in ps:
                st = self.optimizer.state[p]
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
                st["fresh"] = False

    def release_accumulators(self, segments: Sequence[int]) -> None:
        """Sharded AdamA: drop the per-step ``m``/``v`` sums of ``segments``' folded parameters
        (after they were copied into the reduce-scatter buffer); a later fold fails loudly."""
        if self.accumulator is None:
            return
        for s in segments:
            for p in self.folded[s]:
                st = self.accumulator.state[p]
                st["exp_avg"] = st["exp_avg_sq"] = torch.empty(0, device=self.device)

    def fold(self, params: list) -> None:
        """AdamA: fold the gradients of ``params`` into ``m``/``v`` (one micro-batch each; sharded:
        into the per-step :attr:`accumulator`)."""
        if not params:
            return
        (self.accumulator if self.sharded else self.optimizer).fold(params)

    def grad_chunk(self, p: torch.nn.Parameter) -> torch.Tensor:
        """Sharded: the view of the reduce-scattered buffer holding this replica's chunk of ``p``'s
        gradient (``p`` a gradient-reduced parameter: Adam/SGD any, AdamA a tied copy)."""
        s, i = self._chunk_of[id(p)]
        return self.shards[s].grad_chunk(i)

    def step(self, expert_params: list[torch.nn.Parameter], ep: int) -> None:
        """The ``OPTIM`` update: AdamA folds the tied copies' summed gradient once; with expert
        parallelism (``ep > 1``) each expert gradient (every replica's ``grad(loss / m)``) is
        averaged; then ``step()`` and ``zero_grad(set_to_none=True)``. Sharded: the update of this
        replica's shards (:meth:`_sharded_step`). No-op without parameters."""
        if self.optimizer is None:
            return
        if self.sharded:
            self._sharded_step()
            return
        if self.adama:   # tied copies: their summed gradient is folded once per step
            self.optimizer.fold([p for ps in self.unfolded.values() for p in ps])
        for g in self.optimizer.param_groups:   # tensor parallelism: gradients laid out like their parameter
            for p in g["params"]:
                local_grad(p)
        if ep > 1:   # each expert got every replica's grad(loss / m): average it
            for p in expert_params:
                if p.grad is not None:
                    p.grad.div_(ep)
        if self.scaler is not None:   # 16-mixed: unscale, skip on inf/nan (agreed by all ranks), update
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (``16-mixed``); ``loss`` itself without a scaler."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    @torch.no_grad()
    def _sharded_step(self) -> None:
        """``sharded-update``'s ``OPTIM`` on this replica's chunks: refresh the flat parameter shards
        from the parameters, then Adam/SGD on the averaged gradient chunks, or AdamA: the owner's
        persistent ``m``, ``v`` decay once (``b1*m``, ``b2*v``) and take the reduce-scattered sums
        ``(1-b1) sum g``, ``(1-b2) sum g**2`` of every replica's folded micro-batches, the tied
        copies' summed gradient chunks are folded once, and the bias-corrected step follows. The
        parameters' own gradients are released; :meth:`GradientSync.post_all_gather` distributes
        the updated shards."""
        if self._shards_stale:   # else the shards already hold what the last all-gather wrote back
            for sh in self.shards.values():
                sh.load_params(self.shard_index)
            self._shards_stale = False
        if self.adama:
            for sh in self.shards.values():
                self.optimizer.begin_step([sh.param])
                st = self.optimizer.state[sh.param]
                (b1, b2) = self.optimizer.param_groups[0]["betas"]
                m, v, fw = st["exp_avg"], st["exp_avg_sq"], sh.folded_width
                m[:fw].add_(sh.grad[:fw])
                v[:fw].add_(sh.grad[fw:2 * fw])
                g = sh.grad[2 * fw:]
                m[fw:].add_(g, alpha=1 - b1)
                v[fw:].addcmul_(g, g, value=1 - b2)
        else:
            for sh in self.shards.values():
                sh.param.grad = sh.grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def params_changed(self) -> None:
        """The parameters were written outside the optimizer (a loaded checkpoint): the sharded
        update refreshes its flat shards from them before its next step."""
        self._shards_stale = True

    def state_bytes(self) -> int:
        """Bytes of the optimizer's persistent state tensors on this rank: Adam's and AdamA's ``m``
        and ``v`` (a tensor-parallel state: its local shard; scalars such as step counts are left
        out; 0 for SGD without momentum). With ``sharded-update`` those of this replica's chunks,
        ``1/dp`` of the unsharded ones up to the padding of each parameter to a multiple of ``dp``
        (AdamA's per-step accumulators are released between steps and not counted)."""
        if self.optimizer is None:
            return 0
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    lv = local_tensor(v)
                    total += lv.numel() * lv.element_size()
        return total

    def state_dict(self, compact: bool) -> dict | None:
        """The optimizer's ``state_dict`` as CPU copies (``None`` without parameters); ``compact``
        (CUDA) or AdamA (``m``, ``v`` may be views into the flat buffers): tensor-wise CPU clones.
        Sharded: the states of this replica's chunks, plus ``"shard": {"dp", "index", "widths"}``
        (``widths``: ``[[segment, elements], ...]``) that :meth:`load_state_dict` checks."""
        if self.optimizer is None:
            return None
        if self.adama or compact or self.sharded or self._tp_sharded():
            # tensor-parallel states (DTensors) are saved as this rank's local shards
            sd = self.optimizer.state_dict()
            out = {"state": {k: {kk: cpu_copy(local_tensor(vv)) if isinstance(vv, torch.Tensor)
                                 else copy.deepcopy(vv) for kk, vv in v.items()} for k, v in sd["state"].items()},
                   "param_groups": copy.deepcopy(sd["param_groups"])}
            if self.sharded:
                out["shard"] = self._shard_meta()
            return out
        return copy.deepcopy(self.optimizer.state_dict())

    def _shard_meta(self) -> dict:
        return {"dp": self.dp, "index": self.shard_index,
                "widths": [[s, sh.layout.width] for s, sh in sorted(self.shards.items())]}

    def _tp_sharded(self) -> bool:
        return any(local_tensor(p) is not p for g in self.optimizer.param_groups for p in g["params"])

    def load_state_dict(self, sd: dict | None) -> None:
        """Load :meth:`state_dict` output (``None``: nothing); AdamA re-binds the flat buffers; the
        states of tensor-parallel parameters become DTensors again, placed like their parameter.
        Raises :class:`WorkerError` when the checkpoint's states are sharded and this optimizer's
        are not, or the other way round, or sharded for other replicas or segments."""
        if self.optimizer is None or sd is None:
            return
        meta = sd.get("shard")
        if self.sharded or meta is not None:
            if not self.sharded or meta is None:
                raise WorkerError("the checkpoint's optimizer states are "
                                  f"{'' if meta is not None else 'not '}sharded across replicas but this plan "
                                  f"{'uses' if self.sharded else 'does not use'} 'sharded-update'; resume with the "
                                  "plan the checkpoint was saved with")
            if meta != self._shard_meta():
                raise WorkerError(f"the checkpoint's optimizer shard {meta} is not this rank's {self._shard_meta()}; "
                                  "resume with the same plan and rank")
            self.optimizer.load_state_dict({k: v for k, v in sd.items() if k != "shard"})
            self._shards_stale = True
            return
        self.optimizer.load_state_dict(sd)
        if self.adama:
            self.bind_flat_states()
        if self._tp_sharded():
            for p, state in self.optimizer.state.items():
                if local_tensor(p) is p:
                    continue
                for k, v in state.items():   # the global shape given: FSDP's dim-0 shards may be uneven
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == local_tensor(p).shape:
                        state[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                      shape=p.shape, stride=p.stride())

    def remove_hooks(self) -> None:
        """Remove the AdamA folding hooks (idempotent)."""
        for h in self.fold_hooks:
            h.remove()
        self.fold_hooks.clear()
