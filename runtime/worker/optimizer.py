"""A stage worker's optimizer: construction (Adam, SGD, AdamA with per-parameter folding hooks),
AdamA's data-parallel replica logic (flat ``[m | v | tied gradients]`` buffers, owner replica) and
the optimizer's checkpoint state (``docs/runtime-worker.md``, "Optimizers and AdamA")."""

from __future__ import annotations

import copy
from typing import Any

import torch

from runtime.tensor_parallel import local_grad, local_tensor
from runtime.worker.device import cpu_copy
from runtime.worker.errors import WorkerError

__all__ = ["WorkerOptimizer"]


class WorkerOptimizer:
    """The optimizer over this rank's segments' parameters.

    Args:
        name: ``"adam"``, ``"sgd"`` or ``"adama"`` (checked by the caller).
        lr: learning rate.
        seg_params: segment -> its parameters (this rank's segments, in order).
        tied_ids: ``id()`` of the pipeline-tied copies (AdamA does not fold them per micro-batch).
        dp: replicas; with AdamA and ``dp > 1`` the flat all-reduce buffers are allocated.
        device: where the flat buffers live.

    Attributes:
        optimizer: the ``torch.optim`` optimizer, ``None`` without parameters.
        adama: the optimizer is AdamA.
        dp: replicas.
        folded, unfolded: AdamA: segment -> parameters folded per micro-batch / tied copies folded
            once per step (empty otherwise).
        flat_states: AdamA with ``dp > 1``: segment -> flat ``[m | v | tied gradients]`` buffer.
        fold_hooks: the folding hooks' handles.
    """

    def __init__(self, name: str, lr: float, seg_params: dict[int, list[torch.nn.Parameter]], tied_ids: set[int],
                 dp: int, device: torch.device):
        self.adama = name == "adama"
        self.dp = dp
        self.folded: dict[int, list] = {s: [] for s in seg_params}
        self.unfolded: dict[int, list] = {s: [] for s in seg_params}
        self.flat_states: dict[int, torch.Tensor] = {}
        self.fold_hooks: list = []
        self.optimizer: Any = None
        params = [p for ps in seg_params.values() for p in ps]
        if not params:
            return
        if name == "adam":
            self.optimizer = torch.optim.Adam(params, lr=lr)
            return
        if name == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=lr)
            return
        self._build_adama(lr, seg_params, tied_ids, dp, device)

    def _build_adama(self, lr: float, seg_params: dict[int, list[torch.nn.Parameter]], tied_ids: set[int], dp: int,
                     device: torch.device) -> None:
        from runtime.adama import AdamA

        for s, ps in seg_params.items():
            for p in ps:
                (self.unfolded if id(p) in tied_ids else self.folded)[s].append(p)
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
        ``optimizer.state`` directly. A no-op otherwise (not AdamA, ``dp == 1``, replica 0, or
        no parameters)."""
        if not self.adama or self.dp <= 1 or dp_index == 0 or self.optimizer is None:
            return
        for ps in self.folded.values():
            for p in ps:
                st = self.optimizer.state[p]
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
                st["fresh"] = False

    def fold(self, params: list) -> None:
        """AdamA: fold the gradients of ``params`` into ``m``/``v`` (one micro-batch each)."""
        self.optimizer.fold(params)

    def step(self, expert_params: list[torch.nn.Parameter], ep: int) -> None:
        """The ``OPTIM`` update: AdamA folds the tied copies' summed gradient once; with expert
        parallelism (``ep > 1``) each expert gradient (every replica's ``grad(loss / m)``) is
        averaged; then ``step()`` and ``zero_grad(set_to_none=True)``. No-op without parameters."""
        if self.optimizer is None:
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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self, compact: bool) -> dict | None:
        """The optimizer's ``state_dict`` as CPU copies (``None`` without parameters); ``compact``
        (CUDA) or AdamA (``m``, ``v`` may be views into the flat buffers): tensor-wise CPU clones."""
        if self.optimizer is None:
            return None
        if self.adama or compact or self._sharded():
            # tensor-parallel states (DTensors) are saved as this rank's local shards
            sd = self.optimizer.state_dict()
            return {"state": {k: {kk: cpu_copy(local_tensor(vv)) if isinstance(vv, torch.Tensor)
                                  else copy.deepcopy(vv) for kk, vv in v.items()} for k, v in sd["state"].items()},
                    "param_groups": copy.deepcopy(sd["param_groups"])}
        return copy.deepcopy(self.optimizer.state_dict())

    def _sharded(self) -> bool:
        return any(local_tensor(p) is not p for g in self.optimizer.param_groups for p in g["params"])

    def load_state_dict(self, sd: dict | None) -> None:
        """Load :meth:`state_dict` output (``None``: nothing); AdamA re-binds the flat buffers; the
        states of tensor-parallel parameters become DTensors again, placed like their parameter."""
        if self.optimizer is None or sd is None:
            return
        self.optimizer.load_state_dict(sd)
        if self.adama:
            self.bind_flat_states()
        if self._sharded():
            from torch.distributed.tensor import DTensor

            for p, state in self.optimizer.state.items():
                if local_tensor(p) is p:
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == local_tensor(p).shape:
                        state[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)

    def remove_hooks(self) -> None:
        """Remove the AdamA folding hooks (idempotent)."""
        for h in self.fold_hooks:
            h.remove()
        self.fold_hooks.clear()
