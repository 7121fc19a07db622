"""SuperScaler phase 3: lower a schedule into per-rank instruction streams.

Every tensor that crosses devices gets a ``SEND`` right after its producer and a ``RECV``
right before its consumer; data-parallel gradients get an ``ALLREDUCE`` after a segment's
last backward on a rank; every training stream ends with an ``OPTIM`` step.

Collectives beyond data parallelism:

- ``ALLTOALL`` (mixture-of-experts expert parallelism, :mod:`engine.models.moe.comm`): one
  instruction per all-to-all, right after the compute instruction of the ``F``/``B``/``I`` block
  that runs it (before the block's SENDs), in execution order: forward in layer order (dispatch,
  combine), backward in reverse (combine-grad, dispatch-grad). ``group`` is the expert-parallel
  group size (= ``dp``), ``nbytes`` one rank's whole send buffer.
- Tied-weight ``ALLREDUCE`` (e.g. GPT-2's ``wte`` / ``lm_head`` on the first and last pipeline
  rank): on each rank holding a copy, just before ``OPTIM``, ``segment=None`` and
  ``ranks`` = the pipeline ranks of all holders (``group = len(ranks)``); Megatron-LM's embedding
  all-reduce, as ``runtime.worker`` does it at the optimizer step.

Gradient memory: a weight-gradient block (``B``/``W``) carries the gradient buffer it allocates
(``hold``, Adam with gradient accumulation: the segment's first weight-gradient block on the
rank) and its transient micro-batch gradient (``transient``, see
:func:`engine.schedule.gradient_events`); ``OPTIM`` frees the held buffers (``memory``).

Deadlock freedom. ``SEND`` is asynchronous (an ``isend`` whose completion is awaited at the
end of the step) and ``RECV`` blocks until its tensor has arrived, so a rank only ever waits
for a block that some rank has already ordered. If the schedule's orders plus the
placement's dependencies form no cycle (``engine.schedule.validate`` rule ``deadlock``),
every wait is eventually satisfied: the instruction streams cannot deadlock. The simulator
re-checks this and names the waiting ranks if a hand-built stream breaks it. (With NCCL,
whose p2p kernels serialise on one stream, the runtime must post each rank's sends and recvs
for one step boundary together (``batch_isend_irecv``), as torch.distributed.pipelining does.)

The package: :mod:`~engine.dependency.instructions` (``Op``, ``Instruction``, ``TiedGroup``,
``ExecutionPlan``), :mod:`~engine.dependency.options` (:class:`LowerOptions`, one field per
option) and one pass per concern, run in order by :func:`~engine.dependency.passes.lower`
(:data:`~engine.dependency.passes.PASSES`): :mod:`~engine.dependency.compute` (the blocks),
:mod:`~engine.dependency.send_recv` (SEND/RECV, scatter-send, tp-split),
:mod:`~engine.dependency.expert_alltoall`, :mod:`~engine.dependency.grad_sync` (ALLREDUCE,
overlap-grad-sync buckets, sharded-update's REDUCESCATTER), :mod:`~engine.dependency.tied_weights`
and :mod:`~engine.dependency.optimizer_step` (OPTIM, sharded-update's ALLGATHER and static memory).
To add an option: a :class:`LowerOptions` field and the pass that reads it (or a new pass in
``PASSES``).

Source: Lin et al., "SuperScaler: Supporting Flexible DNN Parallelization via a Unified
Abstraction" (2023), section 3 ("data dependency preserving").
"""

from engine.dependency.context import LowerContext
from engine.dependency.instructions import COMPUTE_OPS, ExecutionPlan, Instruction, Op, TiedGroup
from engine.dependency.options import OPTIMIZER_KINDS, LowerOptions
from engine.dependency.passes import PASSES, lower

__all__ = ["COMPUTE_OPS", "ExecutionPlan", "Instruction", "LowerContext", "LowerOptions", "OPTIMIZER_KINDS", "Op",
           "PASSES", "TiedGroup", "lower"]
