"""Model registry: build a model and its example inputs by name.

Names (see :func:`list_models`): HF configs (``gpt2-tiny``, ``gpt2``, ``gpt2-xl``,
``gpt3-175b``, ``llama-tiny``, ``llama-7b``; :mod:`engine.models.hf`), the in-project
``tessel-gpt`` (:mod:`engine.models.gpt`), ``gpt-moe-tiny`` / ``-top2`` / ``-dts``
(:mod:`engine.models.moe`), anything added with :func:`register_model`, and user
code as ``"package.module:callable"``.

User callables: ``build_model("mypkg.models:make_net")`` imports ``mypkg.models`` and calls
``make_net(**kw)`` where ``kw`` holds those of ``batch_size``, ``seq_len``, ``device``, ``dtype``
that the callable's signature accepts, inside ``with torch.device(device):``. It returns either
an ``nn.Module`` — then the example input is int64 token ids ``[batch_size, seq_len or 128]``
(language-model convention) — or a ``(module, example_inputs)`` tuple.
"""
from __future__ import annotations

import importlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from engine.errors import ModelArgumentError, ModelBuildError, ModelNotFoundError, TesselError

from . import hf as _hf
from .gpt import GPT, GPTConfig

__all__ = ["MODEL_DTYPES", "ModelBundle",
           "build_model", "example_inputs_note", "list_models", "register_model"]

#: The parameter/activation dtypes a model can be built in (``--dtype``): floating point only, the
#: ones the cost tables have a peak for.
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


#: Modules whose example inputs Tessel made up (the user's callable returned only a module) ->
#: a description of those inputs, for the capture error (:func:`example_inputs_note`).
_MADE_UP_INPUTS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def example_inputs_note(module: nn.Module) -> str | None:
    """How Tessel made up the example inputs of ``module`` when a user's ``module:callable``
    returned only a module (e.g. ``"'pkg:make' returned only a module, so it was given int64
    token ids [1, 128]; ..."``), or ``None`` when the inputs came from the model's own definition.
    :func:`engine.graph.capture` adds it to a capture failure."""
    return _MADE_UP_INPUTS.get(module)


@dataclass
class ModelBundle:
    """A model ready to capture.

    Attributes:
        module: the ``nn.Module`` (on the requested device; ``meta`` allocates no weights).
        example_inputs: positional forward inputs, e.g. ``(input_ids,)`` int64 ``[batch, seq]``.
        name: registry name (or the ``module:callable`` string).
        source: ``"hf"`` (transformers config), ``"zoo"`` (in-project) or ``"user"``.
        config: JSON-able model configuration.
        batch_size, seq_len: shape of the example inputs (``seq_len`` None when not a sequence
            model).
        task: the task the model trains on (``causal-lm``, ``masked-lm``, ``seq2seq``,
            ``image-classification`` or a user's ``module:callable``; see :mod:`tasks`).
    """

    module: nn.Module
    example_inputs: tuple
    name: str
    source: str
    config: dict = field(default_factory=dict)
    batch_size: int = 1
    seq_len: int | None = None
    task: str = "causal-lm"

    def capture(self, **kwargs: Any):
        """Shortcut for ``engine.graph.capture(self, **kwargs)`` -> OpGraph."""
        from engine.graph import capture
        return capture(self, **kwargs)


@dataclass
class _Spec:
    name: str
    description: str
    source: str
    builder: Callable[..., tuple[nn.Module, dict]]   # (device, dtype) -> (module, config)
    default_seq_len: int
    vocab_size: Callable[[dict], int]
    max_seq_len: Callable[[dict], int | None]
    task: str = "causal-lm"


_REGISTRY: dict[str, _Spec] = {}


def register_model(name: str, builder: Callable[..., tuple[nn.Module, dict]], *,
                   description: str, default_seq_len: int, source: str = "zoo",
                   vocab_size: Callable[[dict], int] = lambda c: int(c["vocab_size"]),
                   max_seq_len: Callable[[dict], int | None] = lambda c: None,
                   task: str = "causal-lm") -> None:
    """Add a named language model to the registry.

    Args:
        builder: ``builder(device=..., dtype=...) -> (module, config_dict)``; called inside
            ``with torch.device(device):``. The module takes int64 token ids ``[B, T]``.
        description: one line for :func:`list_models`.
        default_seq_len: sequence length when ``build_model(seq_len=None)``.
        vocab_size / max_seq_len: read them from the config dict (for example inputs and the
            ``seq_len`` check).
        task: the built-in task it trains on (its example inputs follow the task: token ids
            ``[B, T]``; seq2seq adds decoder ids ``[B, T']``; images ``[B, 1, 8, 8]``).
    """
    _REGISTRY[name] = _Spec(name, description, source, builder, default_seq_len, vocab_size,
                            max_seq_len, task)


_HF_TASKS = {"BertForMaskedLM": "masked-lm", "T5ForConditionalGeneration": "seq2seq"}

for _name, (_arch, _cfgcls, _kw, _seq, _desc) in _hf.HF_SPECS.items():
    register_model(_name, (lambda n: lambda device, dtype: _hf.build_hf(n, device=device,
                                                                       dtype=dtype))(_name),
                   description=_desc, default_seq_len=_seq, source="hf",
                   vocab_size=_hf.vocab_size, max_seq_len=_hf.max_positions,
                   task=_HF_TASKS.get(_arch, "causal-lm"))


def _build_tessel_gpt(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    cfg = GPTConfig()
    with torch.device(device):
        m = GPT(cfg)
    return m.to(dtype=dtype), cfg.to_dict()


register_model("tessel-gpt", _build_tessel_gpt,
               description="in-project nanoGPT-style GPT (engine.models.gpt): 4 layers, hidden 128, "
                           "4 heads, byte vocab 256, 128 positions (~0.8M params)",
               default_seq_len=128, source="zoo", max_seq_len=lambda c: c["block_size"])


def _gpt_moe_builder(gate: str) -> Callable[..., tuple[nn.Module, dict]]:
    def build(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
        from .moe.gpt_moe import GPTMoE, GPTMoEConfig
        cfg = GPTMoEConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=128,
                           num_experts=4, gate=gate)
        with torch.device(device):
            m = GPTMoE(cfg)
        return m.to(dtype=dtype), cfg.to_dict()
    return build


for _suffix, _gate, _gdesc in (("", "switch", "Switch top-1 gate, capacity 1.25"),
                               ("-top2", "top2", "GShard top-2 gate, capacity 1.25"),
                               ("-dts", "dts", "DTS-Gate (Gumbel dense-to-sparse)")):
    register_model(f"gpt-moe-tiny{_suffix}", _gpt_moe_builder(_gate),
                   description=f"in-project GPT-MoE (engine.models.moe): 4 layers, hidden 64, "
                               f"4 heads, 4 experts in layers 1 and 3, {_gdesc}, byte vocab 256, "
                               f"128 positions",
                   default_seq_len=128, source="zoo", max_seq_len=lambda c: c["block_size"])


def byte_gpt2_builder(n_layer: int, n_embd: int, n_head: int, n_positions: int = 256
                      ) -> Callable[..., tuple[nn.Module, dict]]:
    """A builder of an HF GPT-2 byte-level LM (vocab 256, no dropout, sdpa attention) of this
    shape, for :func:`register_model` (``gpt2-small-cpu`` and the benchmarks' larger configs)."""
    def build(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
        import transformers
        cfg = transformers.GPT2Config(
            vocab_size=256, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
            use_cache=False,
            # a PretrainedConfig kwarg that GPT2Config's typed signature does not list
            attn_implementation="sdpa")  # type: ignore[call-arg]
        with torch.device(device):
            module = _hf.logits_only_class(transformers.GPT2LMHeadModel)(cfg)
        module.to(dtype=dtype)
        module.train()
        return module, _hf.config_dict(cfg, "GPT2LMHeadModel")
    return build


_build_gpt2_small_cpu = byte_gpt2_builder(n_layer=6, n_embd=256, n_head=8)


register_model("gpt2-small-cpu", _build_gpt2_small_cpu,
               description="HF GPT-2, 6 layers, hidden 256, 8 heads, byte vocab 256, 256 positions, "
                           "no dropout (~4.8M params; for real CPU training runs)",
               default_seq_len=256, source="hf", vocab_size=_hf.vocab_size,
               max_seq_len=_hf.max_positions)


def _build_digits_cnn(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    from .cnn import digits_cnn
    with torch.device(device):
        m = digits_cnn()
    return m.to(dtype=dtype), {"architecture": "digits_cnn", "num_classes": 10, "image": [1, 8, 8]}


register_model("cnn-digits", _build_digits_cnn,
               description="small CNN (nn.Sequential: 2 conv, max-pool, 2 linear) classifying scikit-learn's "
                           "load_digits 8x8 images into 10 classes (~44k params), task image-classification",
               default_seq_len=0, source="zoo", vocab_size=lambda c: 0, task="image-classification")


def two_tower_builder(**shape: int | float) -> Callable[..., tuple[nn.Module, dict]]:
    """A builder of :class:`engine.models.two_tower.TwoTower` with ``TwoTowerConfig(**shape)``, for
    :func:`register_model` (``two-tower-tiny`` and the benchmarks' larger two-tower models)."""
    def build(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
        from .two_tower import TwoTower, TwoTowerConfig
        cfg = TwoTowerConfig(**shape)  # type: ignore[arg-type]
        with torch.device(device):
            m = TwoTower(cfg)
        return m.to(dtype=dtype), cfg.to_dict()
    return build


register_model("two-tower-base", two_tower_builder(n_layer=12, n_head=12, n_embd=768, proj_dim=256, block_size=512),
               description="in-project two-tower model with BERT-base towers: 12 bidirectional layers each, hidden "
                           "768, 12 heads, byte vocab 256, 512 positions, a parameter-free contrastive head "
                           "(~170M params); task contrastive; for planning Tessel's K placement",
               default_seq_len=256, source="zoo", max_seq_len=lambda c: c["block_size"], task="contrastive")
register_model("two-tower-tiny", two_tower_builder(n_layer=2, n_head=4, n_embd=64, proj_dim=32, block_size=128),
               description="in-project two-tower model (engine.models.two_tower): a docstring tower and a code tower, "
                           "2 bidirectional layers each, hidden 64, byte vocab 256, joined by a parameter-free "
                           "contrastive head; task contrastive (CPython docstring / function-body pairs); fills "
                           "Tessel's K placement",
               default_seq_len=64, source="zoo", max_seq_len=lambda c: c["block_size"], task="contrastive")


def list_models() -> dict[str, str]:
    """Built-in model names -> one-line descriptions (plus the ``module:callable`` form)."""
    out = {n: s.description for n, s in _REGISTRY.items()}
    out["<module>:<callable>"] = ("user code: a callable returning an nn.Module or "
                                  "(module, example_inputs)")
    return out


def _not_found(name: str, why: str = "") -> ModelNotFoundError:
    names = ", ".join(_REGISTRY)
    return ModelNotFoundError(
        f"unknown model {name!r}{': ' + why if why else ''}. Valid names: {names}; or user code "
        f"as 'package.module:callable' (the callable returns an nn.Module or a "
        f"(module, example_inputs) tuple).")


def _token_ids(batch: int, seq: int, vocab: int, device: Any) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.zeros(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def build_model(name: str, *, batch_size: int = 1, seq_len: int | None = None,
                device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32, task: str | None = None) -> ModelBundle:
    """Build model ``name`` and example inputs.

    Args:
        name: a name from :func:`list_models` or ``"package.module:callable"``.
        batch_size: batch dimension of the example inputs.
        seq_len: sequence length (default: the model's usual context, e.g. 1024 for gpt2,
            2048 for gpt3-175b / llama-7b, 128 for the tiny models).
        device: ``"meta"`` (default: shapes only, no memory) or a real device.
        dtype: floating-point dtype of parameters.
        task: the task (``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification``,
            ``module:callable``); ``None``: the model's own (built-in) or :func:`infer_task`
            (user code). It decides the example inputs of a user model that returns none.

    Returns:
        :class:`ModelBundle`; built-in models take ``(input_ids,)`` int64 ``[batch, seq]``
        (zeros on meta, seeded random ids elsewhere) and return logits ``[batch, seq, vocab]``.

    Raises:
        ModelNotFoundError: unknown name, or a ``module:callable`` that cannot be imported.
        ModelArgumentError: (a ValueError) ``batch_size`` or ``seq_len`` below 1, ``seq_len``
            beyond the model's position table, ``dtype`` not one of :data:`MODEL_DTYPES`.
        ModelBuildError: (a TypeError) a ``module:callable`` that is not a Python function or
            ``nn.Module`` class, needs arguments Tessel cannot give, raises, or returns something
            other than a module or ``(module, example_inputs)`` (checked before it is called where
            possible).
    """
    _check_build_args(batch_size, seq_len, dtype)
    if ":" in name and name not in _REGISTRY:
        return _build_user(name, batch_size=batch_size, seq_len=seq_len, device=device,
                           dtype=dtype, task=task)
    spec = _REGISTRY.get(name)
    if spec is None:
        raise _not_found(name)
    module, config = spec.builder(device=device, dtype=dtype)
    if spec.task == "image-classification":
        shape = tuple(config.get("image", (1, 8, 8)))
        images = torch.zeros((batch_size, *shape), dtype=dtype, device=device)
        return ModelBundle(module=module, example_inputs=(images,), name=name, source=spec.source,
                           config=config, batch_size=batch_size, seq_len=None, task=task or spec.task)
    seq = seq_len or spec.default_seq_len
    limit = spec.max_seq_len(config)
    if limit is not None and seq > limit:
        raise ModelArgumentError(f"seq_len {seq} exceeds {name}'s maximum of {limit} positions; use "
                                 f"--seq-len {limit} or less")
    inputs = example_token_inputs(spec.task, batch_size, seq, spec.vocab_size(config), device)
    return ModelBundle(module=module, example_inputs=inputs, name=name, source=spec.source,
                       config=config, batch_size=batch_size, seq_len=seq, task=task or spec.task)


def _check_build_args(batch_size: Any, seq_len: Any, dtype: Any) -> None:
    """Refuse a batch size or sequence length below 1 and a dtype outside :data:`MODEL_DTYPES`
    (one sentence each; ``seq_len=None`` means the model's default)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ModelArgumentError(f"batch_size (the micro-batch size) must be a whole number >= 1, got {batch_size!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ModelArgumentError(f"seq_len must be a whole number >= 1 (or left out for the model's default), "
                                 f"got {seq_len!r}")
    name = str(dtype).replace("torch.", "")
    if not isinstance(dtype, torch.dtype) or name not in MODEL_DTYPES:
        raise ModelArgumentError(f"dtype {name} is not supported; use one of {', '.join(MODEL_DTYPES)}")


def example_token_inputs(task: str, batch: int, seq: int, vocab: int, device: Any) -> tuple:
    """Example inputs of a text task: ``(input_ids [batch, seq],)``, plus ``decoder_input_ids
    [batch, T']`` for ``seq2seq`` (``T'`` = the span-corruption target length,
    :func:`tasks.span.span_corruption_lengths`); ``(text_ids, code_ids)``, ``[batch, seq]`` each, for
    ``contrastive``."""
    ids = _token_ids(batch, seq, vocab, device)
    if task == "contrastive":   # a two-tower model: the text ids and the code ids
        return (ids, _token_ids(batch, seq, vocab, device))
    if task != "seq2seq":
        return (ids,)
    from tasks.span import span_corruption_lengths
    _, tgt = span_corruption_lengths(seq)
    return (ids, _token_ids(batch, tgt, vocab, device))


def _build_user(name: str, *, batch_size: int, seq_len: int | None, device: Any,
                dtype: torch.dtype, task: str | None = None) -> ModelBundle:
    mod_name, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise _not_found(name, f"cannot import module {mod_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing (SyntaxError, ...)
        line = _first_line(e)
        raise ModelBuildError(f"importing {mod_name!r} for --model {name} raised {type(e).__name__}"
                              f"{': ' + line if line else ''}; fix the module so that it imports") from e
    fn: Any = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise _not_found(name, f"module {mod_name!r} has no attribute {attr!r}")
    offered = {"batch_size": batch_size, "seq_len": seq_len, "device": device, "dtype": dtype}
    kw = _call_arguments(name, fn, offered)
    try:
        with torch.device(device):
            result = fn(**kw)
    except TesselError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: any failure becomes one sentence
        line = _first_line(e)
        raise ModelBuildError(f"calling {name}({', '.join(kw)}) raised {type(e).__name__}"
                              f"{': ' + line if line else ''}; fix the callable so that it builds the "
                              "model with these arguments") from e
    if isinstance(result, nn.Module):
        module, inputs = result, None
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        module, inputs = result
    else:
        raise ModelBuildError(f"{name} returned {type(result).__name__}; expected an nn.Module or "
                        f"(module, example_inputs)")
    module = module.to(device=device, dtype=dtype)
    if _hf.is_hf_model(module):   # transparent: same module tree, forward returns logits
        module.__class__ = _hf.logits_only_class(type(module))
        hf_config: Any = module.config
        if getattr(hf_config, "use_cache", None):
            hf_config.use_cache = False
    if inputs is not None and not isinstance(inputs, tuple):
        inputs = tuple(inputs) if isinstance(inputs, list) else (inputs,)
    task = task or infer_task(module, inputs)
    seq = seq_len
    made_up = inputs is None
    if inputs is None:
        if task == "image-classification":
            raise ModelBuildError(f"{name} returned only a module for an image task; return "
                                  "(module, example_inputs) with example images [batch, C, H, W]")
        if ":" in task:
            from tasks import TaskContext, get_task
            ctx = TaskContext(seq_len=seq_len, vocab_size=_vocab(module), model_name=name)
            inputs = tuple(get_task(task, ctx).example_inputs(batch_size))
            if torch.device(device).type == "meta":
                inputs = tuple(t.to("meta") for t in inputs)
        else:
            seq = seq_len or 128
            inputs = example_token_inputs(task, batch_size, seq, _vocab(module) or 2, device)
    if made_up:
        shapes = ", ".join(f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}" for t in inputs
                           if isinstance(t, torch.Tensor))
        _MADE_UP_INPUTS[module] = (f"{name} returned only a module, so Tessel gave it example inputs of the "
                                   f"{task} task ({shapes}); return (module, example_inputs) from {name} with "
                                   "inputs of the shapes and dtypes its forward takes")
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is not None and first.dim() >= 1:
        batch_size = int(first.shape[0])
        if seq is None and first.dim() >= 2 and not first.is_floating_point():
            seq = int(first.shape[1])
    cfg: Any = getattr(module, "config", None)
    config: dict = {"callable": name, "class": type(module).__name__}
    if hasattr(cfg, "to_dict"):
        import json
        config["config"] = json.loads(json.dumps(cfg.to_dict(), default=str))
    return ModelBundle(module=module, example_inputs=inputs, name=name, source="user",
                       config=config, batch_size=batch_size, seq_len=seq, task=task)


def _first_line(e: BaseException) -> str:
    """The first non-blank line of ``str(e)`` (``""`` if none)."""
    return next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")


_CALLABLE_FORM = ("--model takes package.module:callable where the callable is a Python function (or an "
                  "nn.Module subclass) that returns an nn.Module or (module, example_inputs)")


def _call_arguments(name: str, fn: Any, offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call a user's model builder ``fn`` with: those of ``offered``
    (``batch_size``, ``seq_len``, ``device``, ``dtype``) that its signature takes.

    Checked before anything is called: ``fn`` must be a function written in Python (a bound
    method included) or an ``nn.Module`` subclass, and every parameter without a default must be
    one Tessel offers.

    Raises:
        ModelBuildError: a built-in (``os:system``), a class that is not an ``nn.Module``, a value
            that is not callable, or a parameter Tessel cannot fill.
    """
    target = fn.__func__ if inspect.ismethod(fn) else fn
    if inspect.isclass(fn):
        if not issubclass(fn, nn.Module):
            raise ModelBuildError(f"{name} is the class {fn.__qualname__}, not an nn.Module subclass; {_CALLABLE_FORM}")
    elif not inspect.isfunction(target):
        what = ("a built-in function" if inspect.isbuiltin(fn) else
                "not callable" if not callable(fn) else f"a {type(fn).__name__} object, not a Python function")
        raise ModelBuildError(f"{name} is {what}; {_CALLABLE_FORM}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ModelBuildError(f"{name} has no readable signature; {_CALLABLE_FORM}") from None
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [p.name for p in params.values() if p.default is p.empty and (
        p.kind is p.POSITIONAL_ONLY or (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in offered))]
    if missing:
        raise ModelBuildError(f"{name} needs the argument(s) {', '.join(missing)}, which Tessel cannot give: it "
                              f"passes only those of {', '.join(offered)} that the callable takes; give the others "
                              "defaults or wrap it in a function without them")
    return {k: v for k, v in offered.items() if var_kw or k in params}


def _vocab(module: nn.Module) -> int | None:
    v = getattr(getattr(module, "config", None), "vocab_size", None)
    return int(v) if v else None


def infer_task(module: nn.Module, inputs: tuple | None) -> str:
    """The built-in task a user's model most likely trains on: an HF model's by its class
    (:func:`engine.models.hf.hf_task`); else ``image-classification`` when the first example
    input is a float tensor with 3+ dimensions, else ``causal-lm`` (token ids). ``tessel plan
    --task`` overrides it."""
    if _hf.is_hf_model(module):
        return _hf.hf_task(type(module))
    first = next((t for t in inputs or () if isinstance(t, torch.Tensor)), None)
    if first is not None and first.is_floating_point() and first.dim() >= 3:
        return "image-classification"
    return "causal-lm"
