"""Model registry: model names -> builders of a module and its JSON-able configuration.

Names (see :func:`list_models`): HF configs (``gpt2-tiny``, ``gpt2``, ``gpt2-xl``,
``gpt3-175b``, ``llama-tiny``, ``llama-7b``; :mod:`engine.models.hf`), the in-project
``tessel-gpt`` (:mod:`engine.models.gpt`), ``gpt-moe-tiny`` / ``-top2`` / ``-dts``
(:mod:`engine.models.moe`), anything added with :func:`register_model`, user
code as ``"package.module:callable"``, and the path of a Hugging Face ``config.json`` or of a folder
holding one (:func:`config_model_spec`, :mod:`engine.models.hf_config`; ``--model-config``).

User callables (:func:`build_user_module`): ``"mypkg.models:make_net"`` imports ``mypkg.models`` and
calls ``make_net(**kw)`` where ``kw`` holds those of ``batch_size``, ``seq_len``, ``device``,
``dtype`` that the callable's signature accepts, inside ``with torch.device(device):``. It returns
either an ``nn.Module`` (then its example inputs come from its task) or a ``(module,
example_inputs)`` tuple.

This module knows no task: :func:`engine.models.bundle.build_model` joins a registry model with the
example inputs its task gives (a :class:`~engine.models.bundle.ModelBundle`).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from engine.errors import ModelArgumentError, ModelBuildError, ModelNotFoundError, TesselError

from . import hf as _hf
from . import hf_config as _hf_config
from .cnn import digits_cnn
from .gpt import GPT, GPTConfig
from .moe.gpt_moe import GPTMoE, GPTMoEConfig
from .two_tower import TwoTower, TwoTowerConfig

__all__ = ["MODEL_DTYPES", "ModelSpec", "build_user_module", "byte_gpt2_builder", "check_build_args",
           "check_model_name", "config_model_spec", "infer_task", "is_user_model", "list_models", "model_spec",
           "register_model", "two_tower_builder", "user_callable"]

#: The parameter/activation dtypes a model can be built in (``--dtype``): floating point only, the
#: ones the cost tables have a peak for.
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass
class ModelSpec:
    """A registered model (:func:`register_model` documents each field).

    Attributes:
        name: the registry name.
        description: one line for :func:`list_models`.
        source: ``"hf"`` (transformers config) or ``"zoo"`` (in-project).
        builder: ``builder(device=..., dtype=...) -> (module, config_dict)``.
        default_seq_len: tokens per sample when none is asked for (0: not a sequence model).
        vocab_size, max_seq_len: read from the config dict.
        task: the built-in task the model trains on.
    """

    name: str
    description: str
    source: str
    builder: Callable[..., tuple[nn.Module, dict]]   # (device, dtype) -> (module, config)
    default_seq_len: int
    vocab_size: Callable[[dict], int]
    max_seq_len: Callable[[dict], int | None]
    task: str = "causal-lm"


_REGISTRY: dict[str, ModelSpec] = {}


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
    _REGISTRY[name] = ModelSpec(name, description, source, builder, default_seq_len, vocab_size,
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


def is_user_model(name: str) -> bool:
    """Whether ``name`` is user code (``package.module:callable``) rather than a registered name
    or a Hugging Face config path (:func:`engine.models.hf_config.is_config_name`)."""
    return ":" in name and name not in _REGISTRY and not _hf_config.is_config_name(name)


def config_model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face ``config.json`` path (or a folder holding one):
    built by :func:`engine.models.hf_config.build_from_config` on the requested device, its
    default sequence length the config's context, its task from its architecture.

    Raises:
        ModelConfigError: the file cannot be read or has no ``model_type``
            (:func:`engine.models.hf_config.load_model_config`).
    """
    cf = _hf_config.load_model_config(name)

    def build(device: Any, dtype: torch.dtype) -> tuple[nn.Module, dict]:
        return _hf_config.build_from_config(name, device=device, dtype=dtype)
    return ModelSpec(name, f"{cf.model_type} from {cf.path}", "hf", build,
                     _hf_config.config_default_seq_len(cf.fields), _hf.vocab_size, _hf.max_positions,
                     _hf_config.config_task(name))


def registered_spec(name: str) -> ModelSpec | None:
    """The :class:`ModelSpec` registered under ``name`` (built in or by :func:`register_model`), or
    ``None`` (user code, a config path, an unknown name)."""
    return _REGISTRY.get(name)


def model_spec(name: str) -> ModelSpec:
    """The registered model ``name``, or the model of a Hugging Face config path
    (:func:`config_model_spec`: a name ending in ``.json`` or an existing folder).

    Raises:
        ModelNotFoundError: no model has that name (the message lists them and the user-code form).
        ModelConfigError: a config path that cannot be read (:mod:`engine.models.hf_config`).
    """
    spec = _REGISTRY.get(name)
    if spec is None and _hf_config.is_config_name(name):
        return config_model_spec(name)
    if spec is None:
        raise _not_found(name)
    return spec


def check_build_args(batch_size: Any, seq_len: Any, dtype: Any) -> None:
    """Refuse a batch size or sequence length below 1 and a dtype outside :data:`MODEL_DTYPES`
    (one sentence each; ``seq_len=None`` means the model's default).

    Raises:
        ModelArgumentError: one of them is out of range.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ModelArgumentError(f"batch_size (the micro-batch size) must be a whole number >= 1, got {batch_size!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ModelArgumentError(f"seq_len must be a whole number >= 1 (or left out for the model's default), "
                                 f"got {seq_len!r}")
    name = str(dtype).replace("torch.", "")
    if not isinstance(dtype, torch.dtype) or name not in MODEL_DTYPES:
        raise ModelArgumentError(f"dtype {name} is not supported; use one of {', '.join(MODEL_DTYPES)}")


def user_callable(name: str) -> Any:
    """The callable a user's ``package.module:callable`` names (the module imported).

    Raises:
        ModelNotFoundError: the module cannot be imported or lacks the attribute.
        ModelBuildError: the module raised while importing.
    """
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
    return fn


def check_model_name(name: str) -> None:
    """Refuse, without building anything, a model name that names no model: not registered, not
    a readable Hugging Face config path, nor user code whose module imports and has the callable
    (``tessel launch`` checks a plan's model so before Ray starts).

    Raises:
        ModelNotFoundError, ModelConfigError, ModelBuildError: as :func:`model_spec` and
            :func:`user_callable`.
    """
    if is_user_model(name):
        user_callable(name)
    else:
        model_spec(name)


def build_user_module(name: str, *, batch_size: int, seq_len: int | None, device: Any,
                      dtype: torch.dtype) -> tuple[nn.Module, tuple | None]:
    """Import and call a user's ``package.module:callable`` (see the module docstring).

    Returns:
        ``(module, example_inputs)``: the module on ``device`` in ``dtype`` (a Hugging Face model made
        logits-only, without a cache), and its example inputs as a tuple, or ``None`` when the callable
        returned only a module. Example inputs given as a dict (keyword arguments, e.g. a forward
        whose inputs are keyword-only) become positional (:func:`_positional`).

    Raises:
        ModelNotFoundError: the module cannot be imported or lacks the attribute.
        ModelBuildError: the module raised while importing; the callable is not a Python function or
            ``nn.Module`` class, needs arguments Tessel cannot give, raised, or returned something else;
            dict example inputs whose keys are not argument names.
    """
    fn = user_callable(name)
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
    if isinstance(inputs, dict):
        module, inputs = _positional(name, module, inputs)
    elif inputs is not None and not isinstance(inputs, tuple):
        inputs = tuple(inputs) if isinstance(inputs, list) else (inputs,)
    return module, inputs


#: The positional adapters made so far: (model class, input names) -> subclass (:func:`_positional`).
_ADAPTERS: dict[tuple[type, tuple[str, ...]], type] = {}


def _positional(name: str, module: nn.Module, inputs: dict) -> tuple[nn.Module, tuple]:
    """A user's model given with example inputs as a dict (``{"input_ids": ...}``, a tokenizer's
    output; or a forward whose inputs are keyword-only): the inputs as a tuple in the order the
    model is called with. A Hugging Face model (already logits-only) takes its own input names
    positionally; any other model's class is swapped for a transparent subclass whose ``forward``
    takes the dict's keys positionally and calls the model's with them as keywords (parameter names
    unchanged; rebuilt the same way on every rank, which calls the same callable).

    Raises:
        ModelBuildError: a key that is not a string, or a Hugging Face model given inputs other than
            its own (:func:`engine.models.hf.input_names`).
    """
    keys = tuple(inputs)
    if not keys or not all(isinstance(k, str) and k.isidentifier() for k in keys):
        raise ModelBuildError(f"{name} returned example inputs as a dict with keys {list(keys)!r}; give the names of "
                              "its forward's arguments as keys")
    if _hf.is_hf_model(module):
        want = _hf.input_names(type(module))
        if set(keys) != set(want):
            raise ModelBuildError(f"{name} returned example inputs {list(keys)} for a {type(module).__name__}, which "
                                  f"Tessel trains on {list(want)}; return those (e.g. a tokenizer's input_ids only)")
        return module, tuple(inputs[k] for k in want)
    cls = type(module)
    if (cls, keys) not in _ADAPTERS:
        def forward(self: nn.Module, *args: Any) -> Any:
            return cls.forward(self, **dict(zip(keys, args)))
        _ADAPTERS[(cls, keys)] = type(f"{cls.__name__}Positional", (cls,),
                                      {"forward": forward, "__module__": cls.__module__, "_tessel_input_names": keys})
    module.__class__ = _ADAPTERS[(cls, keys)]
    return module, tuple(inputs.values())


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
