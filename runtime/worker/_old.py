"""StageWorker: one rank of a pipelined (and data-parallel) training run.

A plain Python class, one instance per process; the Ray launcher wraps it with ``ray.remote``
and the tests drive it from ``torch.multiprocessing`` processes. Lifecycle::

    w = StageWorker(plan.to_dict(), rank, world_size, "127.0.0.1", port)
    info = w.setup()                 # process group, stage modules, optimizer, buffers
    out = w.step(step, global_batch) # one optimizer step; same global batch on every rank
    loss = w.evaluate(global_batch)  # forward only
    sd = w.state_dict(); w.load_state_dict(sd)
    w.shutdown()

Ranks. ``world_size = dp * pp`` (``tp`` must be 1). Global rank ``r`` is pipeline rank
``r % pp`` of data-parallel replica ``r // pp``; it runs the segments whose forward the
placement puts on its pipeline rank and executes ``engine.dependency.lower(schedule, dp=dp)``'s
stream of that pipeline rank, with peers mapped to the global ranks of its own replica.

Execution (in stream order, exactly like the simulator):

- ``F``: stage forward. Inputs are the model inputs (segment 0), the pre-allocated receive
  buffers of the previous segment (another rank) or the detached outputs of the previous segment
  (same rank); every stage therefore has its own autograd graph. The last segment computes
  ``cross_entropy(logits, targets) / m`` (mean over tokens; ``m`` = micro-batches per replica).
- ``B``: ``torch.autograd.backward`` of the stage outputs with the received (or local) output
  gradients (the scaled loss on the last segment); accumulates parameter gradients and leaves the
  input gradients to send.
- ``I`` / ``W`` (zero-bubble split backward, Qi et al. 2023): ``I`` calls
  ``torch.distributed.pipelining._backward.stage_backward_input`` (input gradients; it keeps the
  intermediate gradients each weight needs, so ``W`` does not recompute the backward) and ``W``
  calls ``stage_backward_weight``. These are PyTorch's own (private) helpers, used by its
  ``ScheduleZBVZeroBubble``. A segment without differentiable inputs (segment 0, whose input is
  token ids) has nothing for ``I`` to compute: its ``I`` is a no-op and its ``W`` runs the full
  backward.
- ``SEND``: ``dist.isend`` of each boundary tensor (activations after F, input gradients after
  B/I; the boolean mask and other non-float or gradient-free tensors travel forward only), in
  stream order: with tag matching on the default group with tag = (boundary, direction,
  micro-batch, tensor index), with ordered matching on the one-directional group of the pair
  (this rank -> peer) with tag 0 (see "Backends."). The handles go to a helper thread that waits
  them in post order (gloo reports a send's completion only through ``wait()``; on CUDA it polls
  ``is_completed()``, see :class:`runtime.send_waiter.SendWaiter`), so the SEND event lasts from the post to its
  completion; the step ends when all of them have completed.
- ``RECV``: ``wait`` on the ``dist.irecv`` into the pre-allocated buffer (the compute stream
  blocks, as in the simulator). Every receive of a step is posted at the step's start
  (``prepost_receives``), so a transfer completes as soon as its sender posts it. Buffers are allocated once in :meth:`StageWorker.setup`, one per
  (boundary, micro-batch, tensor), from the shapes found by :func:`runtime.stage.build_stages`;
  the sender writes straight into them, no pickling, no per-step allocation (the RDMA paper's
  static-shape insight, ``../shared/TECHNIQUES.md``). One buffer per micro-batch, not per
  boundary: a received activation is an input of the stage's autograd graph and must stay intact
  until that micro-batch's backward.
  Tag matching (gloo's default): the tag = (boundary, direction, micro-batch, tensor index)
  matches each receive to its send, so the order in which two ranks post sends and receives
  never matters, and all receives are posted in this rank's stream order. Ordered matching
  (NCCL's only option): the receives from a peer are posted in that PEER's send order on the
  peer's one-directional group (with ``prepost_receives=False`` a RECV posts, still in the
  sender's order, every not yet posted message of that pair up to its own), and the RECV waits
  on its already-posted works.
- ``ALLREDUCE``: data-parallel gradient average of one segment: its gradients are copied into a
  flat pre-allocated buffer, ``dist.all_reduce(SUM, async_op=True)`` over the segment's DP group is
  posted, and ``OPTIM`` waits for it and writes ``sum / dp`` back (the simulator's asynchronous
  collective stream).
- Tied weights (``runtime.stage.PipelineStages.tied``, e.g. ``transformer.wte.weight`` on the
  first segment and ``lm_head.weight`` on the last): before the optimizer step their gradients are
  summed locally and ``all_reduce``d (SUM) over a group of exactly the ranks of this replica that
  hold a copy (Megatron-LM's embedding group), so every copy gets the full gradient and the copies
  stay equal.
  Newer streams carry this as an instruction (``ALLREDUCE`` with ``segment=None`` and
  ``ranks`` = the holders' pipeline ranks, just before ``OPTIM``): the worker then waits the
  segments' DP all-reduces (they write the copies' ``.grad``) and runs it there, with its own
  event; groups no such instruction covered are reduced inside ``OPTIM`` (older plans).
- ``OPTIM``: ``optimizer.step(); optimizer.zero_grad(set_to_none=True)``; then every MoE gate of
  the local stages counts one update (``BaseGate.advance``: DTS-Gate's temperature and hard
  switch follow the optimizer step, as ``GPTMoE.advance_gates`` in single-process training).

Mixture of experts (:mod:`engine.models.moe`; the stages run the model's own eager MoE layers,
see :func:`runtime.stage.build_stages`):

- Aux loss: after each stage forward the sum of its MoE layers' weighted load-balancing losses
  is kept, scaled like the CE loss (``1/m``; ``1/(dp*m)`` with AdamA), and the stage's backward
  (``B``, or ``I`` with the split backward) starts from it as a second root next to the output
  gradient (on the last stage it is added to the loss). The objective is therefore
  ``sum_j (CE_j + aux_j) / (dp*m)``, as :func:`runtime.reference.reference_losses` and
  :mod:`runtime.moe_train` define it; the reported ``losses`` stay the CE alone and the step
  result adds ``aux_losses`` (per micro-batch, this rank's layers summed, unscaled) and ``moe``
  (routing metrics averaged over micro-batches and layers: ``temperature`` (DTS only),
  ``experts_per_token``, ``load_cv``, ``dropped_fraction``, ``balance_loss``, ``load`` per
  expert, and ``count``, the number averaged).
- Expert parallelism (``dp > 1``): every MoE layer of the local stages becomes a
  :class:`runtime.expert_parallel.ExpertParallelMoE` over an expert-parallel group of the same
  ranks as the DP group (its own process group, so an all-to-all never queues behind a posted
  all-reduce); replica ``d`` keeps experts ``[d*E/dp, (d+1)*E/dp)`` (``E % dp != 0`` is a
  :class:`WorkerError`). The all-to-alls run inside the F/B/I/W compute (``W`` of a segment
  without differentiable inputs runs its whole backward, so its backward all-to-alls are there).
  Expert parameters are left out of the DP ``ALLREDUCE`` buffers (each is owned by one replica)
  and, at ``OPTIM``, their gradients are divided by ``dp``: through the all-to-all backward they
  received every replica's ``grad(loss / m)``, i.e. ``dp`` times the averaged gradient
  (:func:`runtime.expert_parallel.allreduce_replicated_grads`). Adam and SGD are exact
  (equal to the single-process reference); AdamA is refused (an expert's micro-batch gradient
  mixes all replicas' micro-batches, so per-micro-batch folding would differ). Each all-to-all
  is a measured event ``Event(rank, "collective", "ALLTOALL", "a2a 1F3", start, end,
  nbytes=one rank's whole send buffer E*C*hidden*4, micro_batch, segment)`` with its wall times
  on the step clock; the stream's ``ALLTOALL`` instructions (one per all-to-all, right after the
  block that runs it) are markers with nothing left to execute.

Optimizers (``optimizer`` argument, else the plan's ``parallel["optimizer"]``, else ``adam``):
``adam`` (``torch.optim.Adam``), ``sgd`` (``torch.optim.SGD``) and ``adama``
(:class:`runtime.adama.AdamA`, Adam accumulation, ``../shared/TECHNIQUES.md``). With ``adam``
and ``sgd`` everything is as described above. With ``adama``:

- Every micro-batch gradient is folded into Adam's ``m`` and ``v`` as soon as it is accumulated
  and freed at once, so no gradient buffer lives across micro-batches. The worker builds
  ``AdamA(..., fold=False)`` and registers its own ``register_post_accumulate_grad_hook`` on the
  folded parameters (``AdamA.fold([p])``): AdamA's ``fold`` flag is per optimizer, and the
  pipeline-tied copies (``tied_local``: two segments each holding a copy, e.g. ``wte`` and
  ``lm_head``, on different ranks or on the same one) must not fold. They sit in a second param
  group and keep their gradients like Adam, because their gradient is the SUM over copies held by
  other segments, which is only known at the end of the step; at ``OPTIM`` they are summed as
  above and then folded ONCE (``AdamA.fold``), i.e. with Adam-accumulation numerics
  (``v`` gets the square of the step's summed gradient). :func:`runtime.reference.reference_losses`
  asks the same question (``runtime.stage.tied_groups``) so it folds exactly the same parameters.
- ``W`` (zero-bubble weight backward) does NOT fire post-accumulate-grad hooks: torch's
  ``stage_backward_weight`` computes weight gradients with ``torch.autograd.grad`` and assigns
  ``weight.grad`` itself. After every ``W`` the worker therefore folds the segment's folded
  parameters explicitly (one micro-batch each); ``B`` and the full backward of segment 0's ``W``
  go through ``torch.autograd.backward`` and fold in the hooks.
- The loss is scaled by ``1 / (dp * m)`` (not ``1 / m``): the folded gradients are the
  ``g' = grad(loss / (dp * m))`` of the single-process formula over all ``dp * m`` micro-batches.
- Exact data parallelism with an "owner" replica: ``m`` and ``v`` are identical on every replica
  after each step. At the start of a step, replicas ``r > 0`` ZERO ``m`` and ``v`` of their
  folded parameters and mark them not fresh (the worker edits ``optimizer.state[p]`` directly),
  while replica 0 decays them (``b1*m``, ``b2*v``) at its first fold as AdamA does. Each replica
  then folds its own micro-batch gradients. ``ALLREDUCE`` of a segment first applies the decay
  to replica 0's parameters that got no gradient (``AdamA.begin_step``), then posts ONE async
  ``all_reduce(SUM)`` over a flat buffer ``[m | v | tied gradients]`` of the segment; ``OPTIM``
  waits for it. Result: ``m = b1*m + (1-b1) * sum g'`` and ``v = b2*v + (1-b2) * sum g'**2`` over
  all ``dp * m`` micro-batches, exactly single-process AdamA; the tied gradients are summed (not
  averaged, the loss is already scaled by ``1/(dp*m)``) and then tied-summed and folded once.
  The ``m`` and ``v`` of the folded parameters ARE views into that flat buffer (allocated once in
  :meth:`StageWorker.setup`, re-bound after :meth:`StageWorker.load_state_dict`), so the
  collective runs in place with no extra copy: data parallelism costs no memory beyond the
  tied gradients' slots (Adam keeps a flat gradient copy the size of the segment). The
  all-reduce moves ``2x`` the parameter bytes (Adam: ``1x``).
- Memory: between instructions, no gradient is held except the tied copies' (``peak_grad_memory``
  in the step result); during ``W`` the segment's weight gradients exist at once until the fold.
- Not supported with ``adama`` (clear errors from :mod:`runtime.adama`): full-gradient clipping,
  ``GradScaler``.

Measurements. Each instruction yields an :class:`engine.timeline.Event` (rank = GLOBAL rank;
names as the simulator's: ``"1F3"``, ``"1F3>2"``, ``"1B2<3"``, ``"allreduce s1"``, ``"optimizer"``;
seconds from the step start, ``time.perf_counter``). Memory is measured two ways after every
instruction: process RSS (``psutil``; includes the interpreter, torch and the receive buffers),
and tensor accounting of activations (bytes of the distinct non-parameter storages the stage
graphs save for backward, via ``torch.autograd.graph.saved_tensors_hooks``; added at F, freed at
B/W; the storages' ``data_ptr`` are device addresses on CUDA, which works unchanged), so the
measured activation curve can be compared with the predicted one.
On CUDA, kernels run asynchronously, so a host timestamp right after a launch is not a completion
time: with ``sync_timing`` (the default on CUDA) the worker calls ``torch.cuda.synchronize()`` at
the end of every F/B/I/W, RECV, tied all-reduce and OPTIM, and before stamping a DP all-reduce's
end (when OPTIM has waited it: NCCL's future completes at launch), then stamps the end. The
measured GPU timeline therefore serialises the host with the device once per instruction (the
next launch waits for the previous kernels; the GPU idles for the launch latency, some
microseconds per instruction), the price of honest per-instruction times. The all-to-alls inside
MoE compute keep host timestamps (launch times on CUDA). Memory on CUDA adds
``torch.cuda.memory_allocated()`` after every instruction (``device_memory``,
``peak_device_memory`` in the step result: the caching allocator's live tensor bytes; RSS does not
see GPU memory). CPU results are unchanged.

Errors. Any exception inside a step is re-raised as :class:`StepError` (a ``RuntimeError``):
``"rank R (pipeline rank P, replica D) failed at step S, instruction I (INS): ..."``, chained to
the original. A worker that failed a step must be shut down (its process killed): peers blocked
in a receive from it fail at once when its process exits and its sockets close ("Connection
closed/reset by peer"), otherwise after the process-group timeout (``timeout_s``; with NCCL,
which does not notice a dead peer's closed sockets, a blocked rank fails when the NCCL watchdog
reaches that timeout, and a send still waited by the send thread after ``timeout_s``).
``fail_at=(step, index)`` raises deliberately at that instruction (for fault-handling tests).

Co-location hooks (``runtime.crossover``). ``on_compute_start(step)`` is called at the start of
:meth:`StageWorker.step` before any instruction runs (before the step's clock starts, so a
wait inside it is not part of the step's events) and at the start of :meth:`StageWorker.evaluate`
(``step=None``); ``on_sync_start(step)`` is called right after the step's last local compute has
been handed off: after the instruction that posts the gradient all-reduce that follows the last
``F``/``B``/``I``/``W`` of the stream (or after that last compute instruction when the stream has no
such ``ALLREDUCE``, e.g. ``dp == 1``), and in :meth:`StageWorker.evaluate` before its loss
all-reduce. Both default to no-ops. A CrossoverScheduler passes a per-device compute token with
them; the optimizer step after the all-reduce runs outside ``on_compute_start``/``on_sync_start``.
A worker that shares its process with other workers (one default process group, each worker with
its own ``new_group`` groups) is built with ``owns_process_group=False``, so its
:meth:`StageWorker.shutdown` leaves the default process group alone.

Backends. ``gloo`` runs CPU tensors (``device="cpu"``) and ``nccl`` CUDA tensors
(``device="cuda"``: ``torch.cuda.set_device`` of ``LOCAL_RANK``, 0 when unset, which under Ray
is the actor's one visible GPU; ``init_process_group(device_id=...)``; stage modules, receive
buffers, flat all-reduce buffers, tied-gradient buffers, optimizer states and the batch on the
GPU; the DP, EP and tied groups use the same backend). Checkpoints (:meth:`StageWorker.state_dict`)
are CPU tensors on both; :meth:`StageWorker.load_state_dict` maps them to the device.
Point-to-point messages are matched one of two ways (``p2p_matching``):

- ``"tags"`` (default with gloo): sends and receives on the default group, matched by tag; any
  posting order works (gloo honours tags).
- ``"ordered"`` (default, and required, with NCCL, which ignores tags, matches sends and receives
  of a communicator by posting order and runs them in order on one stream; ``TESSEL_P2P=ordered``
  selects it with gloo too, which honours order per tag): :meth:`StageWorker.setup` creates one
  2-rank group per ORDERED pair (sender, receiver) of world ranks with traffic, every rank
  calling ``new_group`` for every pair in the same sorted order; a group carries messages from
  its sender to its receiver only, with tag 0. The sender posts its sends in its stream order;
  every rank lowers every pipeline rank's stream (:meth:`StageWorker._peer_streams`) and derives
  each pair's send order (:func:`runtime.p2p_order.pair_send_orders`: per message (boundary, direction,
  micro-batch, tensor index)), and the receiver posts its receives in exactly that order. All
  receives are still posted at the step's start: a pair group carries one direction only, so
  receives queued on it (on NCCL: on its stream) cannot hold back a send of the receiver, which
  goes to other groups; with one group for both directions of a pair, NCCL would queue a
  rank's sends behind its early receives and deadlock. Setup checks once that for every pair
  the receiver expects the same messages the sender sends (as multisets), else
  :class:`WorkerError` names the pair and the first differing message (a silent mismatch would
  deliver tensors into the wrong buffers); then each pair exchanges one tiny message, pairs in
  sorted order, so lazily created NCCL communicators exist before a step. :meth:`StageWorker.evaluate`
  uses the same groups (forward traffic, micro-batch then segment order on both sides).
  Caveat on NCCL: the receives posted at a step's start occupy a NCCL kernel per pair group
  until their sends arrive; NCCL runs kernels of different communicators concurrently, as
  PyTorch's own pipeline schedules rely on.

Sources: torch.distributed (``init_process_group``, ``isend``/``irecv``, ``new_group``,
``all_reduce``), https://pytorch.org/docs/stable/distributed.html; PipeDream-Flush / 1F1B
(Narayanan et al., 2021) and Megatron-LM's tied-embedding all-reduce.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.dependency import Instruction, lower
from engine.models.moe.layer import MoEFeedForward
from engine.timeline import Event
from runtime.device import cpu_copy as _cpu_copy
from runtime.device import module_to as _module_to
from runtime.errors import WorkerError
from runtime.expert_parallel import ExpertParallelMoE, is_expert_param
from runtime.p2p_order import _describe_message, _first_mismatch, pair_send_orders, stream_messages
from runtime.send_waiter import SendWaiter

__all__ = ["OPTIMIZERS", "P2P_MATCHING", "StageWorker", "StepError", "WorkerError", "merge_model_state"]

#: Optimizer names a worker accepts (see the module docstring).
OPTIMIZERS = ("adam", "adama", "sgd")

#: ``p2p_matching`` values of :class:`StageWorker` (module docstring, "Backends.").
P2P_MATCHING = ("auto", "tags", "ordered")


class StepError(RuntimeError):
    """An instruction of :meth:`StageWorker.step` failed.

    ``str(err)`` is ``"rank R (pipeline rank P, replica D) failed at step S, instruction I (INS):
    <cause type>: <cause>"``; ``__cause__`` is the original exception. Attributes (they survive
    pickling, e.g. through Ray): ``rank``, ``pp_rank``, ``dp_index``, ``step``, ``index`` (position
    in the stream, ``None`` when waiting for sends at the end of the step), ``instruction``
    (``"I (INS)"``, e.g. ``"3 (SEND 1B0 to 0)"``, or ``None``).
    """


def _step_error(message: str, *, rank: int, pp_rank: int, dp_index: int, step: int, index: int | None,
                instruction: str | None) -> StepError:
    err = StepError(message)
    err.rank, err.pp_rank, err.dp_index, err.step = rank, pp_rank, dp_index, step
    err.index, err.instruction = index, instruction
    return err


_PROC: Any = None
_STATM: tuple[int, int] | None = None   # (pid, fd of /proc/<pid>/statm)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    """Resident set size of this process in bytes, 0 if unavailable.

    Sampled after every instruction, so it must be cheap: on Linux one ``pread`` of
    ``/proc/self/statm`` (about 2 us; the second field is resident pages, proc(5)), else psutil
    (about 13 us).
    """
    global _PROC, _STATM
    pid = os.getpid()
    try:
        if _STATM is None or _STATM[0] != pid:
            _STATM = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):   # no /proc (macOS) or no os.pread
        pass
    try:
        if _PROC is None or _PROC.pid != pid:
            import psutil
            _PROC = psutil.Process(pid)
        return int(_PROC.memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency
        return 0


class _ActivationMeter:
    """Bytes of distinct non-parameter storages saved for backward, per (segment, micro-batch).

    Counting runs a Python hook per saved tensor, which costs a few per cent of a CPU step, so
    only the first forward of each segment in a step is counted (:attr:`per_segment`): the
    shapes are static (the plan's), so every micro-batch of a segment saves the same bytes
    within a step (an MoE gate changes its capacity only between steps).
    """

    def __init__(self, static_ptrs: set[int]):
        self.static = static_ptrs
        self.live = 0
        self.held: dict[tuple[int, int], int] = {}
        self.per_segment: dict[int, int] = {}
        self._seen: dict[int, int] = {}

    def reset(self) -> None:
        """Start a step: nothing held, every segment counted afresh."""
        self.live, self.held, self.per_segment = 0, {}, {}

    def hooks(self):
        seen = self._seen = {}

        def pack(t: torch.Tensor):
            try:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr and ptr not in self.static and ptr not in seen:
                    seen[ptr] = st.nbytes()
            except Exception:
                pass
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def add(self, key: tuple[int, int], *, nbytes: int | None = None, segment: int | None = None) -> None:
        """Hold ``nbytes`` (default: what the last :meth:`hooks` context saw) for ``key``;
        with ``segment``, remember them as that segment's bytes per micro-batch this step."""
        n = sum(self._seen.values()) if nbytes is None else int(nbytes)
        self.held[key] = n
        self.live += n
        if segment is not None:
            self.per_segment[segment] = n

    def free(self, key: tuple[int, int]) -> None:
        self.live -= self.held.pop(key, 0)


class StageWorker:
    """One rank: its stage modules, optimizer, instruction stream and receive buffers.

    Args:
        plan_dict: ``Plan.to_dict()`` (JSON-able; the worker rebuilds the plan in :meth:`setup`).
        rank: global rank ``0 .. world_size-1`` (= ``dp_index * pp + pp_rank``).
        world_size: ``dp * pp``.
        master_addr, master_port: TCP rendezvous of ``init_process_group``.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors). Anything else is refused by
            :meth:`setup` (:class:`~runtime.stage.RuntimeNotSupported`).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None``: ``"cuda"`` with ``nccl``, else ``"cpu"``.
            ``"cuda"`` picks GPU ``LOCAL_RANK`` (0 when unset; Ray sets ``CUDA_VISIBLE_DEVICES`` to the
            actor's one GPU). ``nccl`` needs a CUDA device and gloo a CPU one (:class:`WorkerError`).
        p2p_matching: how point-to-point messages are matched (module docstring, "Backends."):
            ``"tags"`` (gloo only), ``"ordered"`` (one-directional 2-rank groups, posting order)
            or ``"auto"``: the environment variable ``TESSEL_P2P`` when set, else ``"ordered"``
            with ``nccl`` and ``"tags"`` with gloo.
        sync_timing: on CUDA, ``torch.cuda.synchronize()`` at the end of every compute, receive and
            collective instruction before stamping its end, so measured times are completion
            times (default ``True`` on CUDA; ignored on CPU).
        seed: model initialisation seed (same on every rank and in the reference).
        lr: learning rate.
        optimizer: ``"adam"`` (``torch.optim.Adam``, default betas/eps), ``"adama"``
            (:class:`runtime.adama.AdamA`, default betas/eps, see the module docstring) or ``"sgd"``;
            ``None``: the plan's ``parallel["optimizer"]`` (``"adam"`` when absent).
        timeout_s: process-group timeout (seconds); a rank blocked on a dead peer fails after it.
        fail_at: ``(step, instruction_index)`` at which :meth:`step` raises deliberately (tests).
        track_activations: account saved-activation bytes (see the module docstring).
        on_compute_start, on_sync_start: co-location hooks ``f(step)`` (see the module docstring;
            ``None``: no-ops). An exception from a hook fails the step (or evaluation).
        owns_process_group: :meth:`shutdown` destroys the default process group (``False`` when
            other workers of this process still use it).
        prepost_receives: post every receive of a step at the step's start into its
            pre-allocated buffer, so transfers complete while this rank computes (default);
            ``False`` posts each when its RECV instruction is reached (ordered matching: together
            with the not yet posted messages its sender sends before it).

    Nothing heavy happens here; call :meth:`setup` next (in the worker's own process).
    """

    def __init__(self, plan_dict: dict, rank: int, world_size: int, master_addr: str, master_port: int, *,
                 backend: str = "gloo", seed: int = 0, lr: float = 1e-3, optimizer: str | None = None,
                 timeout_s: float = 300.0, fail_at: tuple[int, int] | None = None,
                 track_activations: bool = True, on_compute_start: Any = None, on_sync_start: Any = None,
                 owns_process_group: bool = True, prepost_receives: bool = True, device: str | None = None,
                 p2p_matching: str = "auto", sync_timing: bool | None = None):
        self.plan_dict = plan_dict
        self.device_name = device if device is not None else ("cuda" if backend == "nccl" else "cpu")
        self.p2p_matching = p2p_matching
        self.sync_timing = sync_timing
        self.prepost_receives = bool(prepost_receives)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.master_addr = str(master_addr)
        self.master_port = int(master_port)
        self.backend = backend
        self.seed = int(seed)
        self.lr = float(lr)
        self.optimizer_name = optimizer
        self.timeout_s = float(timeout_s)
        self.fail_at = tuple(fail_at) if fail_at is not None else None
        self.track_activations = track_activations
        self.on_compute_start = on_compute_start
        self.on_sync_start = on_sync_start
        self.owns_process_group = bool(owns_process_group)
        self._ready = False
        self.device = torch.device("cpu")
        self._cuda = False
        self._ordered = False
        self._sync = None
        self._pair_groups: dict[tuple[int, int], Any] = {}

    # ------------------------------------------------------------------ setup
    def setup(self) -> dict:
        """Join the process group and build everything a step needs.

        Returns:
            ``rank``, ``pp_rank``, ``dp_index``, ``segments`` (run here), ``params`` (count),
            ``param_bytes``, ``buffer_bytes`` (pre-allocated receive buffers), ``num_buffers``,
            ``stream_length``, ``tied`` (tied groups of the whole model, ``[[segment, name], ...]``),
            ``removed`` (pruned leftover parameters, all segments), ``boundaries`` (per boundary, the
            tensors' ``shape``/``dtype``/``requires_grad``), ``optimizer`` (the name in use),
            ``setup_time`` (s), ``rss`` (bytes).

            Also ``device``, ``backend``, ``p2p_matching`` (``"tags"`` or ``"ordered"``) and
            ``p2p_pairs`` (ordered matching: the ``[sender, receiver]`` world-rank pairs with a
            group that include this rank).

        Raises:
            WorkerError: ``world_size != dp * pp``, a rank outside it, an unknown optimizer, a bad
                device / backend / ``p2p_matching`` combination, or (ordered matching) a pair whose
                receiver expects other messages than its sender sends.
            RuntimeNotSupported: ``tp > 1``, a placement the runtime cannot execute, or a backend
                other than gloo and nccl.
        """
        t0 = time.perf_counter()
        torch.set_num_threads(1)
        from engine.io.plan import Plan
        from runtime.stage import build_stages, check_executable

        plan = Plan.from_dict(self.plan_dict, source="plan_dict")
        check_executable(plan)
        self.plan = plan
        pl = plan.schedule.placement
        self.pp = pl.num_devices
        self.dp = int(plan.parallel.get("dp", 1))
        if self.world_size != self.dp * self.pp:
            raise WorkerError(f"world_size {self.world_size} != dp * pp = {self.dp} * {self.pp}; "
                              "start one worker per (replica, pipeline rank)")
        if not 0 <= self.rank < self.world_size:
            raise WorkerError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        self._resolve_device_and_matching()
        name = self.optimizer_name if self.optimizer_name is not None else plan.parallel.get("optimizer") or "adam"
        if name not in OPTIMIZERS:
            raise WorkerError(f"unknown optimizer {name!r}; use one of {', '.join(map(repr, OPTIMIZERS))}")
        self.optimizer_name = name
        self.adama = name == "adama"
        self.pp_rank = self.rank % self.pp
        self.dp_index = self.rank // self.pp
        self.m = int(plan.schedule.num_micro_batches)
        self.S = pl.num_segments

        if self._cuda:
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            kw: dict[str, Any] = {"device_id": self.device} if self._cuda else {}
            dist.init_process_group(self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeout_s), **kw)
        self._timeout = timedelta(seconds=self.timeout_s)

        stages = build_stages(plan, seed=self.seed)
        self.mbs = stages.micro_batch_size
        self.seq_len = stages.seq_len
        self.boundaries = stages.boundaries
        # tensors crossing each boundary forward / with a gradient back (one message each)
        self._counts = [(len(b), sum(1 for m in b if m.requires_grad)) for b in self.boundaries]
        if self._ordered:   # every rank checks every pair alike, before any collective call
            self._pair_orders = pair_send_orders(self._peer_streams(plan), self._counts)
        self.tied = stages.tied
        removed = [list(x) for x in stages.removed]
        self.seg_rank = {s: pl.spec("F", s).devices[0] for s in range(self.S)}
        self.segments = sorted(s for s in range(self.S) if self.seg_rank[s] == self.pp_rank)
        self.modules = {s: stages.modules[s] for s in self.segments}
        model_has_moe = any(isinstance(x, MoEFeedForward) for m in stages.modules.values() for x in m.modules())
        tied_bytes = []   # bytes of one copy of each tied group (for the tied ALLREDUCE instructions)
        for group in self.tied:
            s0, n0 = group[0]
            p0 = dict(stages.modules[s0].named_parameters())[n0]
            tied_bytes.append(p0.numel() * p0.element_size())
        del stages

        # ---- process groups (created in the same order on every rank): DP, then EP, then tied
        self.dp_group = None
        if self.dp > 1:
            for p in range(self.pp):
                g = dist.new_group([d * self.pp + p for d in range(self.dp)])
                if p == self.pp_rank:
                    self.dp_group = g
        self.ep = 1
        self.ep_group = None
        if self.dp > 1 and model_has_moe:
            if self.adama:
                raise WorkerError(
                    "optimizer 'adama' with expert parallelism (an MoE model with dp > 1) is not supported: "
                    "AdamA folds each micro-batch gradient, but an expert's gradient mixes the replicas' "
                    "micro-batches through the all-to-all; use optimizer 'adam' or 'sgd', or dp = 1")
            for p in range(self.pp):   # a separate group on the DP ranks: a2a never queues behind an all-reduce
                g = dist.new_group([d * self.pp + p for d in range(self.dp)])
                if p == self.pp_rank:
                    self.ep_group = g
            self.ep = self.dp
            self._expert_parallelize()
        self.moe_layers = {s: [(n, m) for n, m in self.modules[s].named_modules() if isinstance(m, MoEFeedForward)]
                           for s in self.segments}
        self._ep_layers = [m for s in self.segments for _, m in self.moe_layers[s] if isinstance(m, ExpertParallelMoE)]
        if self._cuda:
            from runtime.stage import retarget_device
            for s in self.segments:
                _module_to(self.modules[s], self.device)
                retarget_device(self.modules[s], self.device)   # traced factory calls say device=cpu

        self.seg_params = {s: [p for p in self.modules[s].parameters()] for s in self.segments}
        # expert parameters (each owned by one replica) stay out of the data-parallel all-reduce
        self.dp_params = {s: [p for p in self.seg_params[s] if not is_expert_param(p)] for s in self.segments}
        self.expert_params = [p for s in self.segments for p in self.seg_params[s] if is_expert_param(p)]
        params = [p for s in self.segments for p in self.seg_params[s]]
        self.last_segment = self.S - 1
        self.has_loss = self.last_segment in self.modules
        # loss scale of a micro-batch (CE and MoE aux): the optimizer sees sum_j grad(loss_j / m)
        # averaged over replicas (Adam/SGD), or AdamA's folded grad(loss_j / (dp * m))
        self._loss_scale = 1.0 / (self.dp * self.m) if self.adama else 1.0 / self.m

        self.stream: list[Instruction] = self._lower(plan, tied_bytes)
        for ins in self.stream:
            if ins.op in ("F", "B", "I", "W") and ins.block.segment not in self.modules:
                raise WorkerError(f"pipeline rank {self.pp_rank}'s stream runs {ins} but segment "
                                  f"{ins.block.segment} is not placed here")
        # on_sync_start fires after this instruction: the ALLREDUCE after the last compute (or that compute)
        last_compute = max((i for i, ins in enumerate(self.stream) if ins.op in ("F", "B", "I", "W")), default=-1)
        self._sync_index = next((i for i in range(last_compute + 1, len(self.stream))
                                 if self.stream[i].op == "ALLREDUCE"), last_compute)
        if self._ordered:
            self._check_own_stream()

        # ---- pre-allocated receive buffers: (boundary, micro-batch) -> [tensor per boundary tensor]
        self.act_buf: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.grad_buf: dict[tuple[int, int], list[torch.Tensor]] = {}
        for ins in self.stream:
            if ins.op != "RECV":
                continue
            pb = ins.block
            if pb.kind == "F":
                b = pb.segment
                self.act_buf[(b, pb.micro_batch)] = [self._empty(meta) for meta in self.boundaries[b]]
            else:
                b = pb.segment - 1
                self.grad_buf[(b, pb.micro_batch)] = [self._empty(meta) for meta in self.boundaries[b]
                                                      if meta.requires_grad]
        self._max_tensors = max([len(x) for x in self.boundaries] + [1])

        self.flat_grads = {}
        if self.dp > 1 and not self.adama:
            for s in self.segments:
                n = sum(p.numel() for p in self.dp_params[s])
                if n:
                    self.flat_grads[s] = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.tied_local: list[tuple[Any, list[torch.nn.Parameter], torch.Tensor, str]] = []
        self._tied_pranks: list[tuple[int, ...]] = []   # pipeline ranks holding each local tied group
        for group in self.tied:
            pranks = sorted({self.seg_rank[s] for s, _ in group})
            for d in range(self.dp):
                granks = [d * self.pp + r for r in pranks]
                g = dist.new_group(granks) if len(granks) > 1 else None
                if d == self.dp_index and self.pp_rank in pranks:
                    named = {(s, n): p for s in self.segments for n, p in self.modules[s].named_parameters()}
                    mine = [named[(s, n)] for s, n in group if (s, n) in named]
                    label = "+".join(f"s{s}:{n}" for s, n in group)
                    self.tied_local.append((g, mine, torch.zeros_like(mine[0]), label))
                    self._tied_pranks.append(tuple(pranks))
        if self._ordered:
            self._build_pair_groups()
        self._build_optimizer(params)

        static_ptrs = {p.untyped_storage().data_ptr() for p in params}
        for bufs in list(self.act_buf.values()) + list(self.grad_buf.values()):
            static_ptrs.update(t.untyped_storage().data_ptr() for t in bufs)
        self._meter = _ActivationMeter(static_ptrs)
        self.buffer_bytes = sum(t.numel() * t.element_size() for bufs in list(self.act_buf.values())
                                + list(self.grad_buf.values()) for t in bufs)
        self._ready = True
        return {
            "rank": self.rank, "pp_rank": self.pp_rank, "dp_index": self.dp_index,
            "segments": list(self.segments), "params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "buffer_bytes": self.buffer_bytes,
            "num_buffers": sum(len(v) for v in self.act_buf.values()) + sum(len(v) for v in self.grad_buf.values()),
            "stream_length": len(self.stream), "tied": [[list(x) for x in g] for g in self.tied],
            "removed": removed, "boundaries": [[m.to_dict() for m in b] for b in self.boundaries],
            "optimizer": self.optimizer_name, "setup_time": time.perf_counter() - t0, "rss": _rss(),
            "device": str(self.device), "backend": self.backend, "p2p_matching": self.p2p_mode,
            "p2p_pairs": [list(k) for k in sorted(self._pair_groups)],
            "moe_layers": {s: [n for n, _ in self.moe_layers[s]] for s in self.segments if self.moe_layers[s]},
            "expert_parallel": self.ep,
            "experts": {n: (m.global_expert_ids() if isinstance(m, ExpertParallelMoE) else list(range(len(m.experts))))
                        for s in self.segments for n, m in self.moe_layers[s]},
        }

    def _resolve_device_and_matching(self) -> None:
        """Check the constructor's ``backend``/``device``/``p2p_matching``/``sync_timing`` and set
        ``self.device`` (a ``torch.device`` with an index on CUDA), ``self._cuda``,
        ``self.p2p_mode`` (``"tags"`` or ``"ordered"``), ``self._ordered`` and ``self._sync``
        (``torch.cuda.synchronize`` of the device, or ``None``: nothing extra per instruction on CPU).

        Raises:
            RuntimeNotSupported: a backend other than gloo and nccl.
            WorkerError: an unknown device or matching mode, nccl without CUDA, gloo with CUDA,
                tags with nccl, no usable GPU.
        """
        from runtime.stage import RuntimeNotSupported

        if self.backend not in ("gloo", "nccl"):
            raise RuntimeNotSupported(f"backend {self.backend!r}: the stage worker runs 'gloo' (CPU tensors) or "
                                      "'nccl' (CUDA tensors)")
        name = str(self.device_name)
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError, ValueError) as e:
            raise WorkerError(f"unknown device {name!r}; use 'cpu', 'cuda' or 'cuda:N'") from e
        if dev.type not in ("cpu", "cuda"):
            raise WorkerError(f"device {name!r}: the stage worker runs on 'cpu' (gloo) or 'cuda' (nccl)")
        if self.backend == "nccl" and dev.type != "cuda":
            raise WorkerError(f"backend 'nccl' moves CUDA tensors only, but device is {name!r}; use device 'cuda' "
                              "(or backend 'gloo' on CPU)")
        if self.backend == "gloo" and dev.type != "cpu":
            raise WorkerError(f"backend 'gloo' with device {name!r}: gloo's point-to-point needs CPU tensors; "
                              "use backend 'nccl' for CUDA")
        mode = self.p2p_matching
        if mode == "auto":
            env = os.environ.get("TESSEL_P2P", "").strip()
            if env and env not in ("tags", "ordered"):
                raise WorkerError(f"TESSEL_P2P={env!r}: use 'tags' or 'ordered' (or unset it)")
            mode = env or ("ordered" if self.backend == "nccl" else "tags")
        if mode not in ("tags", "ordered"):
            raise WorkerError(f"unknown p2p_matching {mode!r}; use one of {', '.join(map(repr, P2P_MATCHING))}")
        if mode == "tags" and self.backend == "nccl":
            raise WorkerError("p2p_matching 'tags' needs gloo: NCCL ignores tags and matches sends and receives by "
                              "their posting order; use 'ordered' (or 'auto')")
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            idx = dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
            if not 0 <= idx < n:
                raise WorkerError(f"device {name!r} needs GPU {idx}, but this process sees {n} CUDA device(s) "
                                  f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use device 'cpu' "
                                  "with backend 'gloo'")
            dev = torch.device("cuda", idx)
        self.device = dev
        self._cuda = dev.type == "cuda"
        self.p2p_mode = mode
        self._ordered = mode == "ordered"
        self._pair_groups = {}
        self._recv_order: dict[int, list[tuple[int, int, int, int]]] = {}
        self._pair_orders: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        sync = True if self.sync_timing is None else bool(self.sync_timing)
        self._sync = (lambda d=dev: torch.cuda.synchronize(d)) if self._cuda and sync else None

    def _empty(self, meta) -> torch.Tensor:
        """An uninitialised tensor of ``meta``'s shape and dtype on this worker's device."""
        if not self._cuda:
            return meta.empty()
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def _peer_streams(self, plan) -> list[list[Instruction]]:
        """Every pipeline rank's stream as far as point-to-point goes: the order in which each rank
        posts its SENDs (and the RECVs it expects), ``engine.dependency.lower(plan.schedule, dp=dp)``.
        The byte arguments :meth:`_lower` adds change no SEND or RECV, only costs and the
        collectives between them (:meth:`_check_own_stream` verifies this rank's). Every rank
        computes the same list, which is what lets it post receives in its peers' send order."""
        return lower(plan.schedule, dp=self.dp).streams

    def _check_own_stream(self) -> None:
        """Ordered matching: this rank's real stream sends exactly the order its peers were told
        (:meth:`_peer_streams`) and receives the same messages. Raises :class:`WorkerError`."""
        me = self.pp_rank
        peers = {ins.peer for ins in self.stream if ins.op in ("SEND", "RECV")}
        peers |= {b for a, b in self._pair_orders if a == me} | {a for a, b in self._pair_orders if b == me}
        for p in sorted(peers):
            mine = stream_messages(self.stream, p, "SEND", self._counts)
            told = self._pair_orders.get((me, p), [])
            if mine != told:
                bad = _first_mismatch(mine, told) or "the same messages in another order"
                raise WorkerError(f"pipeline rank {me}'s stream sends to pipeline rank {p} not in the order its peers "
                                  f"derived from the plan: {bad}")
            got = stream_messages(self.stream, p, "RECV", self._counts)
            bad = _first_mismatch(self._pair_orders.get((p, me), []), got)
            if bad:
                raise WorkerError(f"point-to-point pair pipeline rank {p} -> pipeline rank {me}: {bad} "
                                  f"(pipeline rank {me}'s own stream)")

    def _build_pair_groups(self) -> None:
        """Ordered matching: one 2-rank process group per ORDERED pair of world ranks with
        traffic (training SEND/RECV of :attr:`_pair_orders` in every replica, plus
        :meth:`evaluate`'s forward boundaries), each carrying messages from its first rank to its
        second only. ``dist.new_group`` is called by EVERY rank for every pair, in sorted order
        (torch.distributed requires all ranks to create all groups in one order). Then each group
        is connected with one 1-element message, pairs in sorted order (deadlock-free: the
        smallest unfinished pair always has both ranks waiting on it), so NCCL communicators
        created lazily at a group's first send/receive exist before a step posts its receives."""
        pairs = set(self._pair_orders)
        for s in range(self.S - 1):   # evaluate()'s forward traffic
            a, b = self.seg_rank[s], self.seg_rank[s + 1]
            if a != b:
                pairs.add((a, b))
        world_pairs = sorted((d * self.pp + a, d * self.pp + b) for d in range(self.dp) for a, b in pairs)
        for src, dst in world_pairs:
            g = dist.new_group([src, dst])
            if self.rank in (src, dst):
                self._pair_groups[(src, dst)] = g
        self._recv_order = {src: list(self._pair_orders.get((src % self.pp, dst % self.pp), []))
                            for src, dst in self._pair_groups if dst == self.rank}
        one = torch.zeros(1, device=self.device)
        for (src, dst), g in sorted(self._pair_groups.items()):
            if src == self.rank:
                w = dist.isend(one, dst, group=g, tag=0)
            else:
                w = dist.irecv(torch.empty_like(one), src, group=g, tag=0)
            w.wait(self._timeout)
            if self._cuda:
                torch.cuda.synchronize(self.device)

    def _lower(self, plan, tied_bytes: list[int]) -> list[Instruction]:
        """This pipeline rank's instruction stream (``engine.dependency.lower``), from what this
        worker actually built: the local segments' parameter bytes (experts: this replica's
        share), the bytes their DP ``ALLREDUCE`` reduces (experts excluded), the expert-parallel
        all-to-alls of each local segment (``ALLTOALL`` markers with the engine's byte formula,
        ``engine.models.moe.comm.moe_segment_collectives``) and the tied groups (a tied
        ``ALLREDUCE`` before ``OPTIM`` where their copies span pipeline ranks). For a fresh plan
        this equals ``engine.planner.lower_plan(plan)``'s stream of this rank."""
        from engine.dependency import TiedGroup
        from engine.models.moe.comm import find_moe_layers, moe_segment_collectives

        seg_bytes = {s: sum(p.numel() * p.element_size() for p in self.seg_params[s]) for s in self.segments}
        ar_bytes = {s: sum(p.numel() * p.element_size() for p in self.dp_params[s]) for s in self.segments}
        tokens = self.mbs * self.seq_len
        alltoalls = {s: moe_segment_collectives(find_moe_layers(self.modules[s], tokens), self.ep, "F")
                     for s in self.segments if self.moe_layers[s]} if self.ep > 1 else {}
        tied = [TiedGroup(tuple(sorted((int(s), str(n)) for s, n in group)), int(nb))
                for group, nb in zip(self.tied, tied_bytes)]
        ex = lower(plan.schedule, dp=self.dp, segment_param_bytes=seg_bytes, segment_allreduce_bytes=ar_bytes,
                   optimizer_kind="adama" if self.optimizer_name == "adama" else "adam", alltoalls=alltoalls,
                   tied=tied)
        return ex.streams[self.pp_rank]

    def _expert_parallelize(self) -> None:
        """Replace every MoE layer of the local stages by an :class:`ExpertParallelMoE` over the
        EP group (this pipeline rank's ``dp`` replicas; replica ``d`` keeps experts
        ``[d*E/dp, (d+1)*E/dp)``). Raises :class:`WorkerError` when ``E`` is not divisible by ``dp``."""
        for s in self.segments:
            for name, layer in [(n, m) for n, m in self.modules[s].named_modules() if type(m) is MoEFeedForward]:
                e = layer.gate.num_experts
                if e % self.dp:
                    raise WorkerError(
                        f"the MoE layer {name} has {e} experts, which cannot be split over dp={self.dp} replicas "
                        f"(expert parallelism keeps E/dp experts per replica); choose dp dividing {e}")
                parent_name, _, attr = name.rpartition(".")
                parent = self.modules[s].get_submodule(parent_name) if parent_name else self.modules[s]
                # check_shapes=False: every replica runs the plan's static micro-batch shape
                ep = ExpertParallelMoE.from_dense(layer, self.ep_group, check_shapes=False)
                setattr(parent, attr, ep)
                if not parent_name:
                    setattr(self.modules[s].inner, attr, ep)

    def _build_optimizer(self, params: list) -> None:
        """``self.optimizer`` for ``self.optimizer_name``; with ``adama`` also the folding hooks,
        the folded/tied split (``self.folded``/``self.unfolded`` per segment) and, with ``dp > 1``,
        the flat ``[m | v | tied gradients]`` buffers ``self.flat_states`` (module docstring)."""
        self.folded: dict[int, list] = {s: [] for s in self.segments}
        self.unfolded: dict[int, list] = {s: [] for s in self.segments}
        self.flat_states: dict[int, torch.Tensor] = {}
        self._fold_hooks: list = []
        if not params:
            self.optimizer = None
            return
        if self.optimizer_name == "adam":
            self.optimizer = torch.optim.Adam(params, lr=self.lr)
            return
        if self.optimizer_name == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=self.lr)
            return
        from runtime.adama import AdamA

        tied_ids = {id(p) for _, ps, _, _ in self.tied_local for p in ps}
        for s in self.segments:
            for p in self.seg_params[s]:
                (self.unfolded if id(p) in tied_ids else self.folded)[s].append(p)
        folded = [p for s in self.segments for p in self.folded[s]]
        unfolded = [p for s in self.segments for p in self.unfolded[s]]
        groups = [{"params": ps} for ps in (folded, unfolded) if ps]
        # fold=False: AdamA's flag is per optimizer; the folded group gets the worker's hooks below
        self.optimizer = AdamA(groups, lr=self.lr, fold=False)
        opt = self.optimizer
        for p in folded:
            self._fold_hooks.append(p.register_post_accumulate_grad_hook(lambda q: opt.fold([q])))
        if self.dp > 1:
            for s in self.segments:
                n = sum(p.numel() for p in self.folded[s])
                t = sum(p.numel() for p in self.unfolded[s])
                if n + t:
                    self.flat_states[s] = torch.zeros(2 * n + t, dtype=torch.float32, device=self.device)
            self._bind_flat_states()

    def _bind_flat_states(self) -> None:
        """Make every folded parameter's ``m``/``v`` a view into its segment's flat buffer (values
        kept), so the data-parallel all-reduce of :meth:`_post_allreduce` runs in place."""
        for s, flat in self.flat_states.items():
            n = sum(p.numel() for p in self.folded[s])
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

    def _begin_replica_step(self) -> None:
        """AdamA data parallelism, replicas ``r > 0``: zero ``m``/``v`` of the folded parameters and
        mark them not fresh (replica 0 alone carries ``b1*m``/``b2*v``; the SUM all-reduce adds
        the replicas' folded gradients to it). Edits ``optimizer.state`` directly."""
        for s in self.segments:
            for p in self.folded[s]:
                st = self.optimizer.state[p]
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
                st["fresh"] = False

    def _grad_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for ps in self.seg_params.values() for p in ps
                   if p.grad is not None)

    # ------------------------------------------------------------------ helpers
    def _global(self, pp_rank: int) -> int:
        return self.dp_index * self.pp + pp_rank

    def _tag(self, boundary: int, direction: int, mb: int, k: int) -> int:
        return ((boundary * 3 + direction) * max(self.m, 1) + mb) * self._max_tensors + k

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        """The pre-allocated receive buffers by name (``"act b1 mb0 t0"``, ``"grad b1 mb0 t0"``);
        the same tensor objects every step (tests compare their ``data_ptr``)."""
        out = {}
        for (b, j), bufs in sorted(self.act_buf.items()):
            for k, t in enumerate(bufs):
                out[f"act b{b} mb{j} t{k}"] = t
        for (b, j), bufs in sorted(self.grad_buf.items()):
            for k, t in enumerate(bufs):
                out[f"grad b{b} mb{j} t{k}"] = t
        return out

    def _split_batch(self, batch: torch.Tensor, per_replica: int | None = None):
        if not self._ready:
            raise WorkerError("call setup() before step()/evaluate()")
        if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point:
            raise WorkerError(f"the batch must be an integer tensor [rows, seq_len + 1], got "
                              f"{getattr(batch, 'dtype', type(batch).__name__)} {tuple(getattr(batch, 'shape', ()))}")
        rows_needed = None if per_replica is None else self.dp * per_replica * self.mbs
        if batch.shape[1] != self.seq_len + 1 or (rows_needed is not None and batch.shape[0] != rows_needed) \
                or batch.shape[0] % (self.dp * self.mbs):
            want = f"[{rows_needed if rows_needed else 'dp*k*micro_batch_size'}, {self.seq_len + 1}]"
            raise WorkerError(f"the global batch has shape {list(batch.shape)}, expected {want} "
                              f"(dp={self.dp}, micro_batch_size={self.mbs}, seq_len={self.seq_len})")
        per = batch.shape[0] // self.dp
        rows = batch[self.dp_index * per:(self.dp_index + 1) * per].long()
        if self._cuda:
            rows = rows.to(self.device)
        k = per // self.mbs
        inputs = [rows[j * self.mbs:(j + 1) * self.mbs, :-1].contiguous() for j in range(k)]
        targets = [rows[j * self.mbs:(j + 1) * self.mbs, 1:].contiguous() for j in range(k)]
        return inputs, targets

    # ------------------------------------------------------------------ step
    def step(self, step: int, batch: torch.Tensor) -> dict:
        """Run one training step (all ``m`` micro-batches of this replica, then the optimizer).

        Args:
            step: step number (only used for ``fail_at`` and the result).
            batch: the GLOBAL batch, int64 ``[dp * m * micro_batch_size, seq_len + 1]``, identical
                on every rank; replica ``d`` takes rows ``d*m*mbs .. (d+1)*m*mbs - 1`` and its
                micro-batch ``j`` the ``j``-th ``mbs`` rows of those; inputs ``[:, :-1]``, targets
                ``[:, 1:]``.

        Returns:
            ``losses``: per micro-batch mean cross-entropy (nats/token, NOT divided by ``m``) in
            micro-batch order on the rank holding the last segment, else ``[]``; ``events``:
            ``Event.to_dict()`` per executed instruction; ``rank``, ``pp_rank``, ``dp_index``,
            ``step``; ``time`` (s); ``start`` (``time.perf_counter()`` at the step's start, the
            origin of the events' times); ``peak_memory`` (bytes, max process RSS sampled after every
            instruction); ``memory`` (``[[t, rss_bytes], ...]``); ``activation_memory``
            (``[[t, bytes], ...]``) and ``peak_activation_memory`` (tensor accounting);
            ``peak_grad_memory`` (bytes of parameter gradients held, sampled after every
            instruction that can grow them, B/I/W/ALLREDUCE: the whole segment with Adam/SGD, only the tied copies with AdamA).
            Ranks whose segments hold MoE layers add ``aux_losses`` (per micro-batch, the sum
            of their layers' weighted aux losses, unscaled) and ``moe`` (routing metrics, see
            the module docstring); the events then include one ``ALLTOALL`` per all-to-all.
            On CUDA also ``device_memory`` (``[[t, bytes], ...]``, ``torch.cuda.memory_allocated``
            after every instruction) and ``peak_device_memory`` (bytes).

        Raises:
            StepError: (a ``RuntimeError``) ``"rank R (pipeline rank P, replica D) failed at step
                S, instruction I (INS): ..."`` chained to the cause.
            WorkerError: not set up, or a batch of the wrong shape.
        """
        model_inputs, targets = self._split_batch(batch, per_replica=self.m)
        if self.on_compute_start is not None:
            self.on_compute_start(step)
        st = _StepState(model_inputs, targets)
        self._meter.reset()
        for layer in self._ep_layers:   # collectives outside a step (evaluate) are not events
            layer.comm_log.clear()
        t0 = time.perf_counter()
        st.t0 = t0
        st.now = lambda: time.perf_counter() - t0
        where = f"rank {self.rank} (pipeline rank {self.pp_rank}, replica {self.dp_index})"
        mem = [[0.0, _rss()]]
        act_mem = [[0.0, 0]]
        dev_mem = [[0.0, torch.cuda.memory_allocated(self.device)]] if self._cuda else None
        grad_peak = 0
        if self.adama and self.dp > 1 and self.dp_index > 0 and self.optimizer is not None:
            self._begin_replica_step()
        st.sends = SendWaiter(st.now, self._timeout, device=self.device if self._cuda else None)
        try:
            if self.prepost_receives:
                self._post_all_recvs(st)
            for idx, ins in enumerate(self.stream):
                try:
                    if self.fail_at is not None and (int(step), idx) == self.fail_at:
                        raise RuntimeError("deliberate failure requested by fail_at")
                    self._execute(ins, st)
                    if idx == self._sync_index and self.on_sync_start is not None:
                        self.on_sync_start(step)
                except Exception as e:
                    raise _step_error(f"{where} failed at step {step}, instruction {idx} ({ins}): "
                                      f"{type(e).__name__}: {e}", rank=self.rank, pp_rank=self.pp_rank,
                                      dp_index=self.dp_index, step=int(step), index=idx,
                                      instruction=f"{idx} ({ins})") from e
                t = st.now()
                mem.append([t, _rss()])
                act_mem.append([t, self._meter.live])
                if dev_mem is not None:
                    dev_mem.append([t, torch.cuda.memory_allocated(self.device)])
                if self.track_activations and ins.op in ("B", "I", "W", "ALLREDUCE"):   # the ops that grow .grad
                    grad_peak = max(grad_peak, self._grad_bytes())
        except BaseException:
            st.sends.abandon()
            raise
        try:
            st.sends.close()
            self._finish_allreduces(st)   # no-op after OPTIM (lower() always ends training with it)
        except Exception as e:
            raise _step_error(f"{where} failed at step {step} waiting for its sends/all-reduces: "
                              f"{type(e).__name__}: {e}", rank=self.rank, pp_rank=self.pp_rank,
                              dp_index=self.dp_index, step=int(step), index=None, instruction=None) from e
        out = {
            "rank": self.rank, "pp_rank": self.pp_rank, "dp_index": self.dp_index, "step": int(step),
            "losses": [st.losses[j] for j in sorted(st.losses)] if self.has_loss else [],
            "events": [e.to_dict() for e in st.events], "time": st.now(), "start": t0,
            "peak_memory": int(max(v for _, v in mem)), "memory": mem,
            "activation_memory": act_mem, "peak_activation_memory": int(max(v for _, v in act_mem)),
            "peak_grad_memory": int(grad_peak),
        }
        if dev_mem is not None:   # CUDA: the caching allocator's live tensor bytes on this rank's GPU
            out["device_memory"] = dev_mem
            out["peak_device_memory"] = int(max(v for _, v in dev_mem))
        if st.moe:
            out["aux_losses"] = [sum(st.aux[(s, j)] for s in self.segments if (s, j) in st.aux)
                                 for j in range(self.m)]
            out["moe"] = _mean_metrics(st.moe)
        return out

    def _post_recv(self, ins: Instruction, st: "_StepState") -> tuple[list[torch.Tensor], list, int]:
        """Post the ``irecv``s of a RECV instruction into its pre-allocated buffers:
        ``(buffers, works, source world rank)``. Ordered matching: the works of its messages,
        posting first whatever precedes them in the sender's order (:meth:`_post_ordered_until`)."""
        pb = ins.block
        j = pb.micro_batch
        if pb.kind == "F":
            boundary, direction = pb.segment, 0
            bufs = self.act_buf[(boundary, j)]
        else:
            boundary, direction = pb.segment - 1, 1
            bufs = self.grad_buf[(boundary, j)]
        src = self._global(ins.peer)
        if self._ordered:
            works = []
            for k in range(len(bufs)):
                msg = (boundary, direction, j, k)
                self._post_ordered_until(src, msg, st)
                works.append(st.owork.pop((src, msg)))
            return bufs, works, src
        works = [dist.irecv(t, src, tag=self._tag(boundary, direction, j, k)) for k, t in enumerate(bufs)]
        return bufs, works, src

    def _post_ordered_until(self, src: int, msg: tuple, st: "_StepState") -> None:
        """Ordered matching: post the receives from world rank ``src`` in ``src``'s send order
        (``self._recv_order[src]``) up to and including ``msg``, each into its own buffer, on the
        ``src -> self`` pair group. A no-op when ``msg`` is already posted."""
        if (src, msg) in st.owork:
            return
        order = self._recv_order.get(src, [])
        i = st.cursor.get(src, 0)
        group = self._pair_groups[(src, self.rank)]
        while i < len(order):
            m = order[i]
            i += 1
            st.owork[(src, m)] = dist.irecv(self._msg_buffer(m), src, group=group, tag=0)
            if m == msg:
                break
        st.cursor[src] = i
        if (src, msg) not in st.owork:
            raise WorkerError(f"rank {self.rank} expects {_describe_message(msg)} from rank {src}, which is not "
                              f"in rank {src}'s send order (or was received already)")

    def _msg_buffer(self, msg: tuple) -> torch.Tensor:
        """The pre-allocated receive buffer of ``(boundary, direction, micro_batch, tensor)``."""
        b, direction, j, k = msg
        return (self.act_buf if direction == 0 else self.grad_buf)[(b, j)][k]

    def _post_all_recvs(self, st: "_StepState") -> None:
        """Post every receive of the step at its start, each into its own pre-allocated buffer
        (one per boundary tensor and micro-batch, so no two receives of a step share one): a
        transfer then completes as soon as its sender posts it, while this rank still computes,
        instead of when this rank reaches the RECV (gloo moves the data only once both sides have
        posted). The buffers of the previous step are free by now: a step ends after every
        backward that read them."""
        if self._ordered:   # each pair group carries one direction only: early receives block no send
            for src, order in self._recv_order.items():
                if order:
                    self._post_ordered_until(src, order[-1], st)
            return
        for ins in self.stream:
            if ins.op == "RECV":
                st.recvs[(ins.block, ins.peer)] = self._post_recv(ins, st)

    def _execute(self, ins: Instruction, st: "_StepState") -> None:
        op = ins.op
        now = st.now
        if op in ("F", "B", "I", "W"):
            b = ins.block
            s, j = b.segment, b.micro_batch
            start = now()
            if op == "F":
                self._forward(s, j, st)
            elif op == "B":
                self._backward(s, j, st)
            elif op == "I":
                self._backward_input(s, j, st)
            else:
                self._backward_weight(s, j, st)
            if self._sync is not None:   # CUDA: stamp the kernels' completion, not their launch
                self._sync()
            st.events.append(Event(self.rank, "compute", op, str(b), start, now(), 0, j, s))
            if self._ep_layers:
                self._record_all_to_alls(b, st)
        elif op == "SEND":
            b = ins.block
            s, j = b.segment, b.micro_batch
            if b.kind == "F":
                tensors = [t.detach() for t in st.outputs.pop((s, j))]
                boundary, direction = s, 0
            else:
                tensors = st.in_grads.pop((s, j))
                boundary, direction = s - 1, 1
            dst = self._global(ins.peer)
            start = now()
            sent = [t.contiguous() for t in tensors]
            if self._ordered:   # the receiver posts its receives in this (stream) order
                group = self._pair_groups[(self.rank, dst)]
                works = [dist.isend(t, dst, group=group, tag=0) for t in sent]
            else:
                works = [dist.isend(t, dst, tag=self._tag(boundary, direction, j, k)) for k, t in enumerate(sent)]
            ev = Event(self.rank, "send", "SEND", f"{b}>{dst}", start, -1.0,
                       sum(t.numel() * t.element_size() for t in sent), j, s)
            st.events.append(ev)
            st.sends.add(works, sent, ev)
        elif op == "RECV":
            pb = ins.block
            start = now()
            posted = st.recvs.pop((pb, ins.peer), None)
            bufs, works, src = posted if posted is not None else self._post_recv(ins, st)
            for w in works:
                w.wait(self._timeout)
            if self._sync is not None:   # CUDA: wait() only orders the compute stream after the transfer
                self._sync()
            st.events.append(Event(self.rank, "recv", "RECV", f"{pb}<{src}", start, now(),
                                   sum(t.numel() * t.element_size() for t in bufs), pb.micro_batch, pb.segment))
        elif op == "ALLREDUCE":
            if ins.segment is None:   # the tied-weight all-reduce across pipeline ranks (wte / lm_head)
                self._finish_allreduces(st)   # DP averages first: they write the tied copies' .grad
                self._tied_allreduce(st, tuple(ins.ranks))
            else:
                self._post_allreduce(ins.segment, st)
        elif op == "ALLTOALL":
            pass   # marker: the all-to-all ran inside its block's compute, which recorded its event
        elif op == "OPTIM":
            self._finish_allreduces(st)
            self._tied_allreduce(st, None)   # groups no ALLREDUCE instruction handled (older plans)
            start = now()
            if self.optimizer is not None:
                if self.adama:   # tied copies: their summed gradient is folded once per step
                    self.optimizer.fold([p for s in self.segments for p in self.unfolded[s]])
                if self.ep > 1:   # each expert got every replica's grad(loss / m): average it
                    for p in self.expert_params:
                        if p.grad is not None:
                            p.grad.div_(self.ep)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            for s in self.segments:   # gates count optimizer updates (DTS temperature, hard switch)
                for _, layer in self.moe_layers[s]:
                    layer.gate.advance()
            if self._sync is not None:
                self._sync()
            nbytes = sum(p.numel() * p.element_size() for ps in self.seg_params.values() for p in ps)
            st.events.append(Event(self.rank, "compute", "OPTIM", "optimizer", start, now(), nbytes, -1, -1))
        else:
            raise WorkerError(f"unknown instruction {op!r}")

    def _record_all_to_alls(self, block, st: "_StepState") -> None:
        """One measured ``ALLTOALL`` event per all-to-all that ran inside ``block``'s compute
        (``ExpertParallelMoE.comm_log``, wall times on the step's clock), in start order."""
        recs = []
        for layer in self._ep_layers:
            recs.extend(layer.comm_log)
            layer.comm_log.clear()
        for r in sorted(recs, key=lambda r: r["start"]):
            st.events.append(Event(self.rank, "collective", "ALLTOALL", f"a2a {block}", r["start"] - st.t0,
                                   r["end"] - st.t0, int(r["bytes_total"]), block.micro_batch, block.segment))

    def _forward(self, s: int, j: int, st: "_StepState") -> None:
        if s == 0:
            ins = (st.model_inputs[j],)
        else:
            src = self.act_buf.get((s - 1, j))
            if src is None:                       # previous segment ran on this rank
                src = st.outputs.pop((s - 1, j))
            ins = tuple(t.detach().requires_grad_(True) if meta.requires_grad else t.detach()
                        for t, meta in zip(src, self.boundaries[s - 1]))
        if self.track_activations and s not in self._meter.per_segment:
            with self._meter.hooks():   # the step's first forward of this segment: count what it saves
                outs, loss, aux = self._run_stage(s, j, ins, st)
            self._meter.add((s, j), segment=s)
        else:
            outs, loss, aux = self._run_stage(s, j, ins, st)
            if self.track_activations:   # static shapes: every micro-batch saves what the first did
                self._meter.add((s, j), nbytes=self._meter.per_segment[s])
        if s != self.last_segment:
            st.outputs[(s, j)] = outs
        st.ctx[(s, j)] = (ins, outs, loss, aux)

    def _run_stage(self, s: int, j: int, ins: tuple, st: "_StepState"):
        """Run segment ``s`` on micro-batch ``j``: ``(outputs, scaled CE loss or None, scaled MoE aux
        loss or None)``; scale ``1/m`` (``1/(dp*m)`` with AdamA, whose folded gradients are the
        single-process ``grad(loss / (dp * m))``)."""
        outs = self.modules[s](*ins)
        aux = self._collect_moe(s, j, st)
        if s != self.last_segment:
            return outs, None, aux
        logits = outs[0]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), st.targets[j].reshape(-1))
        st.losses[j] = float(loss.detach())
        return outs, loss * self._loss_scale, aux

    def _collect_moe(self, s: int, j: int, st: "_StepState"):
        """After segment ``s``'s forward of micro-batch ``j``: the sum of its MoE layers' aux
        (load-balancing) losses times the loss scale (``None`` without MoE layers), and their
        routing metrics into ``st.moe``. Drops the layers' references to the routing tensors."""
        layers = self.moe_layers.get(s)
        if not layers:
            return None
        auxes = []
        for _, layer in layers:
            if layer.last_aux_loss is not None:
                auxes.append(layer.last_aux_loss)
            if layer.last_metrics:
                st.moe.append(_metric_floats(layer.last_metrics))
            layer.last_aux_loss, layer.last_gate_output = None, None
        if not auxes:
            return None
        aux = torch.stack(auxes).sum()
        st.aux[(s, j)] = float(aux.detach())
        return aux * self._loss_scale

    def _roots(self, s: int, j: int, st: "_StepState"):
        """(tensors, grad_tensors) the backward of (s, j) starts from."""
        _ins, outs, loss, aux = st.ctx[(s, j)]
        if s == self.last_segment:
            return [loss if aux is None else loss + aux], None
        grads = self.grad_buf.get((s, j))
        if grads is None:                          # next segment ran on this rank
            grads = st.in_grads.pop((s + 1, j))
        tensors = [o for o, meta in zip(outs, self.boundaries[s]) if meta.requires_grad]
        grads = list(grads)
        if aux is not None:   # the stage's MoE aux loss is a second root of its backward
            tensors.append(aux)
            grads.append(torch.ones_like(aux))
        return tensors, grads

    def _diff_inputs(self, s: int, ins: tuple) -> list:
        if s == 0:
            return []
        return [x for x, meta in zip(ins, self.boundaries[s - 1]) if meta.requires_grad]

    def _backward(self, s: int, j: int, st: "_StepState") -> None:
        tensors, grads = self._roots(s, j, st)
        ins = st.ctx.pop((s, j))[0]
        torch.autograd.backward(tensors, grads)
        self._meter.free((s, j))
        if s > 0:
            st.in_grads[(s, j)] = [x.grad if x.grad is not None else torch.zeros_like(x)
                                   for x in self._diff_inputs(s, ins)]

    def _backward_input(self, s: int, j: int, st: "_StepState") -> None:
        from torch.distributed.pipelining._backward import stage_backward_input
        tensors, grads = self._roots(s, j, st)
        xs = self._diff_inputs(s, st.ctx[(s, j)][0])
        if not xs:   # nothing to send (segment 0): W runs the whole backward
            st.wstate[(s, j)] = ("full", tensors, grads)
            return
        dinputs, groups = stage_backward_input(tensors, grads, xs, iter(self.seg_params[s]))
        st.wstate[(s, j)] = ("groups", groups)
        st.in_grads[(s, j)] = [g if g is not None else torch.zeros_like(x) for x, g in zip(xs, dinputs)]

    def _backward_weight(self, s: int, j: int, st: "_StepState") -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight
        state = st.wstate.pop((s, j))
        if state[0] == "full":
            torch.autograd.backward(state[1], state[2])
        else:
            stage_backward_weight(iter(self.seg_params[s]), state[1])
            if self.adama:   # stage_backward_weight assigns .grad without firing the fold hooks
                self.optimizer.fold(self.folded[s])
        st.ctx.pop((s, j), None)
        self._meter.free((s, j))

    def _post_allreduce(self, s: int | None, st: "_StepState") -> None:
        start = st.now()
        ev = Event(self.rank, "collective", "ALLREDUCE", f"allreduce s{s}", start, -1.0, 0, -1,
                   s if s is not None else -1)
        st.events.append(ev)
        if self.adama:
            flat = self.flat_states.get(s)
            if flat is None or self.dp_group is None:
                ev.end = start
                return
            self.optimizer.begin_step(self.folded[s])   # replica 0: decay what got no gradient
            # tied copies: their gradients, summed, after the m | v views
            _flatten_grads(flat, self.unfolded[s], 2 * sum(p.numel() for p in self.folded[s]))
            self._post_flat(flat, s, ev, st)
            return
        flat = self.flat_grads.get(s)
        if flat is None or self.dp_group is None:
            ev.end = start
            return
        _flatten_grads(flat, self.dp_params[s], 0)
        self._post_flat(flat, s, ev, st)

    def _post_flat(self, flat: torch.Tensor, s: int, ev: Event, st: "_StepState") -> None:
        """Post the async SUM all-reduce of ``flat`` over the DP group; :meth:`_finish_allreduces` waits."""
        ev.nbytes = flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
        now = st.now

        def done(_fut, ev=ev):
            ev.end = now()

        if not self._cuda:   # NCCL's future completes at launch: stamped when OPTIM has waited it instead
            try:   # completion time from gloo's callback thread; else the time OPTIM waits for it
                work.get_future().then(done)
            except Exception:
                pass
        st.allreduces.append((work, s, ev))

    def _finish_allreduces(self, st: "_StepState") -> None:
        for work, s, ev in st.allreduces:
            work.wait(self._timeout)
            if ev.end < 0:
                if self._sync is not None:
                    self._sync()
                ev.end = st.now()
            if self.adama:   # m, v were reduced in place (views); copy the tied gradients back
                _unflatten_grads(self.flat_states[s], self.unfolded[s], 2 * sum(p.numel() for p in self.folded[s]))
                continue
            flat = self.flat_grads[s]
            flat.div_(self.dp)
            _unflatten_grads(flat, self.dp_params[s], 0)
        st.allreduces.clear()

    def _tied_allreduce(self, st: "_StepState", ranks: tuple[int, ...] | None) -> None:
        """Sum the tied copies' gradients over their holders (Megatron's embedding all-reduce).

        ``ranks``: from an ``ALLREDUCE`` instruction with ``segment=None``, the pipeline ranks of
        the group it reduces (``()``: every local group); ``None``: at ``OPTIM``, the groups no such
        instruction handled this step. An instruction always yields one event (zero-length when
        nothing here is left to reduce)."""
        todo = [i for i in range(len(self.tied_local)) if i not in st.tied_done
                and (not ranks or tuple(sorted(ranks)) == self._tied_pranks[i])]
        if ranks is not None and not todo:
            t = st.now()
            st.events.append(Event(self.rank, "collective", "ALLREDUCE", "allreduce tied", t, t, 0, -1, -1))
            return
        for i in todo:
            st.tied_done.add(i)
            group, params, buf, label = self.tied_local[i]
            start = st.now()
            buf.zero_()
            for p in params:
                if p.grad is not None:
                    buf.add_(p.grad)
            if group is not None:
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
            for p in params:
                if p.grad is None:
                    p.grad = buf.clone()
                else:
                    p.grad.copy_(buf)
            if self._sync is not None:
                self._sync()
            st.events.append(Event(self.rank, "collective", "ALLREDUCE", f"allreduce tied {label}", start,
                                   st.now(), buf.numel() * buf.element_size(), -1, -1))

    # ------------------------------------------------------------------ evaluate
    @torch.no_grad()
    def evaluate(self, batch: torch.Tensor) -> float | None:
        """Forward-only loss on a global batch.

        Args:
            batch: int64 ``[dp * k * micro_batch_size, seq_len + 1]`` for any ``k >= 1``, the same on
                every rank (replica ``d`` takes its ``k`` micro-batches as in :meth:`step`).

        Returns:
            On ranks holding the last segment: the mean cross-entropy (nats/token) over all
            ``dp * k`` micro-batches (averaged across replicas with an all-reduce); ``None`` elsewhere.

        The micro-batches run one after another through the segments (GPipe forward order), with
        ``isend``/``irecv`` between ranks into the pre-allocated buffers (micro-batch ``j`` uses the
        buffers of ``j % m``). The stage graphs keep the train/eval mode they were traced in
        (see :mod:`runtime.stage`).
        """
        model_inputs, _targets = self._split_batch(batch)
        if self.on_compute_start is not None:
            self.on_compute_start(None)
        k = len(model_inputs)
        total = 0.0
        pending = []
        try:
            for j in range(k):
                prev: tuple | None = None
                for s in range(self.S):
                    r = self.seg_rank[s]
                    if r != self.pp_rank:
                        prev = None
                        continue
                    if s == 0:
                        ins = (model_inputs[j],)
                    elif self.seg_rank[s - 1] == self.pp_rank and prev is not None:
                        ins = prev
                    else:
                        bufs = self.act_buf.get((s - 1, j % self.m))
                        if bufs is None:
                            bufs = [self._empty(meta) for meta in self.boundaries[s - 1]]
                        src = self._global(self.seg_rank[s - 1])
                        if self._ordered:   # the sender's order: micro-batch, then segment (this loop's)
                            group = self._pair_groups[(src, self.rank)]
                            works = [dist.irecv(t, src, group=group, tag=0) for t in bufs]
                        else:
                            works = [dist.irecv(t, src, tag=self._tag(s - 1, 2, j % self.m, q))
                                     for q, t in enumerate(bufs)]
                        for w in works:
                            w.wait(self._timeout)
                        ins = tuple(bufs)
                    outs = self.modules[s](*ins)
                    if s == self.last_segment:
                        logits = outs[0]
                        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                       _targets[j].reshape(-1)))
                    elif self.seg_rank[s + 1] != self.pp_rank:
                        dst = self._global(self.seg_rank[s + 1])
                        group = self._pair_groups.get((self.rank, dst)) if self._ordered else None
                        for q, t in enumerate(outs):
                            t = t.contiguous()
                            if group is not None:
                                pending.append((dist.isend(t, dst, group=group, tag=0), t))
                            else:
                                pending.append((dist.isend(t, dst, tag=self._tag(s, 2, j % self.m, q)), t))
                        prev = None
                    else:
                        prev = outs
                # wait this micro-batch's sends before the next one reuses the tags
                for w, _ in pending:
                    w.wait(self._timeout)
                pending.clear()
        except Exception as e:
            raise RuntimeError(f"rank {self.rank} (pipeline rank {self.pp_rank}, replica {self.dp_index}) "
                               f"failed in evaluate: {type(e).__name__}: {e}") from e
        finally:
            for s in self.segments:   # routing of the last forward: not part of training
                for _, layer in self.moe_layers[s]:
                    layer.last_aux_loss, layer.last_gate_output, layer.last_metrics = None, None, {}
            for layer in self._ep_layers:
                layer.comm_log.clear()
        if self.on_sync_start is not None:
            self.on_sync_start(None)
        if not self.has_loss:
            return None
        mean = torch.tensor([total / k], dtype=torch.float64, device=self.device if self._cuda else None)
        if self.dp > 1:
            dist.all_reduce(mean, group=self.dp_group)
            mean /= self.dp
        return float(mean)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's model shards and optimizer state (plain tensors and dicts, CPU copies).

        ``{"rank", "pp_rank", "dp_index", "segments": {segment: {param name: tensor}},
        "optimizer": torch optimizer state_dict or None}``. Parameter names are the original
        model's (``transformer.h.3.mlp.c_fc.weight``); tied copies appear under each holder's
        name. MoE gate state (``num_updates``, DTS ``temperature``/``sparse``) is included; with
        expert parallelism each replica saves only its own experts, under their GLOBAL names
        (``transformer.h.1.mlp.experts.3.c_fc.weight``), so :func:`merge_model_state` of all
        ranks' states is the unsplit model's ``state_dict``. Loadable by :meth:`load_state_dict`
        of a worker of the same plan and rank. Every tensor is a CPU tensor, also on CUDA (so
        checkpoint files do not depend on the device; :meth:`load_state_dict` maps them back).
        """
        if not self._ready:
            raise WorkerError("call setup() before state_dict()")
        segs = {s: {k: _cpu_copy(v) for k, v in self.modules[s].state_dict().items()} for s in self.segments}
        opt = None
        if self.optimizer is not None:
            import copy
            if self.adama or self._cuda:   # compact CPU clones (AdamA: m, v may be views into the flat buffers)
                sd = self.optimizer.state_dict()
                opt = {"state": {k: {kk: _cpu_copy(vv) if isinstance(vv, torch.Tensor) else copy.deepcopy(vv)
                                     for kk, vv in v.items()} for k, v in sd["state"].items()},
                       "param_groups": copy.deepcopy(sd["param_groups"])}
            else:
                opt = copy.deepcopy(self.optimizer.state_dict())
        return {"rank": self.rank, "pp_rank": self.pp_rank, "dp_index": self.dp_index, "segments": segs,
                "optimizer": opt}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` output (strict: every parameter of every local segment).

        CPU tensors (any checkpoint) are copied onto this worker's device: module tensors by
        ``load_state_dict``'s in-place copies, optimizer states by ``torch.optim``'s loading, which
        casts them to their parameter's device.

        Raises:
            WorkerError: the checkpoint belongs to other segments.
        """
        if not self._ready:
            raise WorkerError("call setup() before load_state_dict()")
        segs = {int(k): v for k, v in sd["segments"].items()}
        if sorted(segs) != self.segments:
            raise WorkerError(f"the checkpoint holds segments {sorted(segs)}, but rank {self.rank} runs "
                              f"{self.segments}")
        for s in self.segments:
            self.modules[s].load_state_dict(segs[s])
        if self.optimizer is not None and sd.get("optimizer") is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
            if self.adama:
                self._bind_flat_states()

    def shutdown(self) -> None:
        """Remove the AdamA fold hooks and destroy the process group (idempotent); with
        ``owns_process_group=False`` the default process group is left to its owner."""
        for h in getattr(self, "_fold_hooks", []):
            h.remove()
        if getattr(self, "_fold_hooks", None):
            self._fold_hooks.clear()
        if self.owns_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._ready = False


def merge_model_state(states) -> dict[str, torch.Tensor]:
    """The unsplit model's ``state_dict`` from every rank's :meth:`StageWorker.state_dict`.

    Args:
        states: the ranks' state dicts (any order; all ranks of one replica at least, and with
            expert parallelism all replicas, so that every expert is present).

    Returns:
        ``{name: tensor}``, the union of the ranks' segment entries. Entries held by several
        ranks (replicated parameters of the replicas, tied copies such as ``wte``/``lm_head``
        under their own names) are taken from the lowest rank; replicas hold identical values.
        Load it with ``model.load_state_dict(state)`` into the plan's model.
    """
    out: dict[str, torch.Tensor] = {}
    for sd in sorted(states, key=lambda d: int(d.get("rank", 0))):
        for _seg, entries in sorted(sd["segments"].items(), key=lambda kv: int(kv[0])):
            for k, v in entries.items():
                out.setdefault(k, v)
    return out


def _flatten_grads(flat: torch.Tensor, params, offset: int) -> None:
    """Copy each parameter's ``.grad`` (zeros where ``None``) into consecutive slices of ``flat``."""
    o = offset
    for p in params:
        n = p.numel()
        if p.grad is None:
            flat[o:o + n].zero_()
        else:
            flat[o:o + n].copy_(p.grad.reshape(-1))
        o += n


def _unflatten_grads(flat: torch.Tensor, params, offset: int) -> None:
    """Write consecutive slices of ``flat`` (from ``offset``) into each parameter's ``.grad``."""
    o = offset
    for p in params:
        n = p.numel()
        g = flat[o:o + n].view_as(p)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        o += n


_METRIC_KEYS = ("temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss")


def _metric_floats(metrics: dict) -> dict:
    """One MoE layer's ``last_metrics`` (detached tensors) as floats; ``load`` as a list."""
    out = {k: float(metrics[k]) for k in _METRIC_KEYS if k in metrics}
    if "load" in metrics:
        out["load"] = [float(v) for v in metrics["load"]]
    return out


def _mean_metrics(items: list[dict]) -> dict:
    """Mean over layers and micro-batches of :func:`_metric_floats` dicts; ``temperature`` only
    where finite (DTS-Gate), ``count`` = items averaged (for weighted means across ranks)."""
    import math

    out: dict = {"count": len(items)}
    for k in _METRIC_KEYS:
        vals = [d[k] for d in items if k in d and math.isfinite(d[k])]
        if vals:
            out[k] = sum(vals) / len(vals)
    loads = [d["load"] for d in items if "load" in d]
    if loads and all(len(x) == len(loads[0]) for x in loads):
        out["load"] = [sum(col) / len(loads) for col in zip(*loads)]
    return out


class _StepState:
    """Per-step bookkeeping of :meth:`StageWorker.step` (dropped at the end of the step)."""

    def __init__(self, model_inputs: list, targets: list):
        self.model_inputs = model_inputs
        self.targets = targets
        self.outputs: dict[tuple[int, int], tuple] = {}   # (segment, mb) -> outputs awaiting SEND / next stage
        self.ctx: dict[tuple[int, int], tuple] = {}       # (segment, mb) -> (inputs, outputs, scaled loss)
        self.in_grads: dict[tuple[int, int], list] = {}   # (segment, mb) -> input grads awaiting SEND / B(s-1)
        self.wstate: dict[tuple[int, int], tuple] = {}    # (segment, mb) -> what W needs after I
        self.losses: dict[int, float] = {}
        self.aux: dict[tuple[int, int], float] = {}       # (segment, mb) -> unscaled MoE aux loss
        self.moe: list[dict] = []                         # routing metrics per (segment, mb, layer)
        self.tied_done: set[int] = set()                  # tied groups reduced this step
        self.t0 = 0.0                                     # perf_counter at the step's start
        self.events: list[Event] = []
        self.sends: SendWaiter | None = None              # waits the isends, stamps SEND ends
        self.allreduces: list[tuple] = []                 # (work, segment, event)
        self.recvs: dict[tuple, tuple] = {}               # (block, peer) -> (buffers, irecv works, src) posted early
        self.owork: dict[tuple, Any] = {}                 # ordered matching: (src, message) -> posted irecv work
        self.cursor: dict[int, int] = {}                  # ordered matching: src -> messages of its order posted
        self.now = lambda: 0.0
