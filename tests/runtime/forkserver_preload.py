"""What the worker harness's fork server imports once, before it forks any rank (not a test module).

``worker_harness.WorkerPool`` forks every rank's process from a ``forkserver`` that imported this
module (``worker_harness._context`` puts this folder on the server's ``PYTHONPATH``: Python 3.11's
fork server ignores the parent's ``sys.path``, and a preload it cannot import is skipped silently).
Everything imported here is inherited, so a rank's process starts in milliseconds: a rank that
imported transformers' model classes (``transformers`` loads ``LlamaForCausalLM`` and the others
lazily, on first use), ``torch.export``'s tracer and pytest (``worker_harness`` imports it) on its
own took seconds on two cores, and the suite forks several hundred ranks. Profiled with py-spy over
the whole suite, those imports were about a third of all CPU time spent in rank processes.

Last, the imported objects are moved out of the garbage collector's reach (``gc.freeze``, Python's
documented use before ``fork``): a worker's set-up runs ``gc.collect()`` for its memory baseline,
which otherwise walks every object of torch and transformers in every rank and, by touching them,
copies every page the fork shared (a fifth of the rank processes' CPU time in the same profile).
"""

from __future__ import annotations

import gc

import pytest  # noqa: F401 - worker_harness imports it; each child unpickles _pool_main from there
import torch  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export._trace  # noqa: F401 - the tracer split's first export imports it lazily
import transformers  # noqa: F401
import worker_harness  # noqa: F401
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401 - the model families the runtime tests build
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.mixtral import modeling_mixtral  # noqa: F401

import runtime.stages  # noqa: F401
import runtime.worker  # noqa: F401

gc.freeze()
