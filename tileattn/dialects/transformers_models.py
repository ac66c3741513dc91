"""Which transformers models may run with the "tileattn" attention implementation, found from the
model itself rather than from a list, so that an architecture of a newer transformers is judged too.

transformers accepts any registered implementation name for any model. An architecture whose
attention modules never look the implementation up in ``AttentionInterface`` computes attention
itself, and when it builds its masks through ``masking_utils`` it gets the mask registered for the
name; the SDPA-style bool mask is then read as eager's additive one and the results are wrong (BLOOM,
XGLM, MPNet, ...; MPT crashes). So the mask builder that :func:`register` installs looks, the first
time a model builds a mask, at the model (the module whose forward is building it) and:

* **refuses** it (:class:`UnsupportedModelError`, at its first forward) when one of its attention
  modules never reaches the interface, naming the architecture and what to use instead; with the
  opt-out (``register(allow_bypass=True)`` or ``TILEATTN_HF_ALLOW_BYPASS=1``) it warns and builds the
  mask eager builds, so the model computes exactly what it computes with ``attn_implementation="eager"``.
  Only the modules that read that mask are judged (:func:`mask_readers`): a multimodal model's
  language model for a mask built for its text config, not its vision or audio towers; the decoder
  for the mask ``generate`` builds above an encoder-decoder model, not an encoder that builds its own;
* gives **eager's mask** (a float bias, never skipped) to a model that calls the interface but does not
  declare SDPA support (``_supports_sdpa``): such models are only tested by transformers on eager's
  masks, and some rely on them (BigBird-Pegasus's and NLLB-MoE's decoders flag no ``is_causal``, so
  the causal mask SDPA leaves out for them would be lost);
* gives the **SDPA-style mask** otherwise.

A model whose modules never consult the implementation at all (no interface, no mask builder: XLNet,
DeBERTa, ...) computes eager's result whatever the name; nothing of tileattn runs in it, so nothing
can refuse it at its forward: :func:`check_model` reports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import re
import sys
import warnings
import weakref
from typing import NamedTuple, Optional

import torch

#: Set to 1 to run models whose attention bypasses tileattn anyway (on their own attention and eager's mask).
ALLOW_BYPASS_ENV = "TILEATTN_HF_ALLOW_BYPASS"


class UnsupportedModelError(ValueError):
    """A model asked for the tileattn attention implementation computes attention itself."""


class Architecture(NamedTuple):
    """One row of the tested architecture table."""

    name: str
    model_type: str
    uses_tileattn: bool
    handling: str  #: one of HANDLING
    notes: str


#: How the integration treats an architecture (the ``handling`` of a table row).
HANDLING = {
    "routed": "calls tileattn; gets transformers' SDPA-style bool mask",
    "routed, eager mask": "calls tileattn; declares no SDPA support, so it gets the mask eager builds, as a bias",
    "refused": "computes attention itself and builds its masks through transformers: UnsupportedModelError at its "
               "first forward (opt-out: eager's mask and the model's own attention)",
    "unaffected": "computes attention itself and builds no mask through transformers: the result is eager's; "
                  "check_model reports it",
}

_MISREAD = "computes attention itself on transformers' mask; the SDPA-style mask gave wrong logits (rel. error "
_BY_NAME = ("picks its attention class from a table keyed by implementation name (KeyError('tileattn') before "
            "register() gave the name eager's class there); that class computes attention itself")

def _transformers_release() -> tuple:
    """The installed transformers' (major, minor), (0, 0) when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in re.findall(r"\d+", version("transformers"))[:2])
    except PackageNotFoundError:
        return (0, 0)


#: Falcon's attention called transformers' AttentionInterface from release 5.25 on; before, its
#: classes came from a table keyed by implementation name and computed attention themselves.
_FALCON = (Architecture("Falcon", "falcon", True, "routed", "calls the interface since transformers 5.25 (refused "
                        "before: its attention classes came from a table keyed by name and computed attention "
                        "themselves)")
           if _transformers_release() >= (5, 25) else Architecture("Falcon", "falcon", False, "refused", _BY_NAME))

#: Architectures tested with transformers 5.24 and 5.25 (``tests/test_transformers_models.py`` builds a tiny
#: random model of each from its config and checks the claim of its row: routed ones call tileattn
#: and match eager; refused ones raise at their first forward and, with the opt-out, match eager).
ARCHITECTURES = (
    Architecture("Llama", "llama", True, "routed", "logits, greedy tokens and a training step match eager/sdpa"),
    Architecture("Mistral", "mistral", True, "routed", "GQA, sliding window (inside transformers' mask)"),
    Architecture("Qwen2", "qwen2", True, "routed", "GQA"),
    Architecture("Qwen3", "qwen3", True, "routed", "GQA, q/k norms"),
    Architecture("Gemma 2", "gemma2", True, "routed", "softcap honoured natively; sliding and full layers"),
    Architecture("Gemma 3", "gemma3_text", True, "routed", "sliding and full layers"),
    Architecture("gpt-oss", "gpt_oss", True, "routed", "learnable sinks (s_aux), sliding and full layers"),
    Architecture("DeepSeek-V3", "deepseek_v3", True, "routed", "MLA: the value head dim differs from the key's"),
    Architecture("DeepSeek-V3.2", "deepseek_v32", True, "routed", "top-k sparse attention (indices)"),
    Architecture("MiniMax-M3", "minimax_m3_vl_text", True, "routed", "top-k block-sparse attention (block_indices)"),
    Architecture("Granite SWA", "granite_swa", True, "routed", "learnable sinks (s_aux) applied as an LSE rescale"),
    Architecture("T5", "t5", True, "routed", "relative position_bias; encoder, decoder and cross-attention"),
    Architecture("GPT-2", "gpt2", True, "routed", "absolute positions; Conv1D projections"),
    Architecture("LongT5", "longt5", True, "routed, eager mask",
                 "position_bias; no _supports_sdpa; its encoder's local attention builds its own masks (generate "
                 "with a static cache is judged on the decoder)"),
    Architecture("BigBird-Pegasus (decoder)", "bigbird_pegasus", True, "routed, eager mask",
                 "its decoder flags no is_causal: on the SDPA mask (causal part left out) it was not causal"),
    Architecture("NLLB-MoE", "nllb-moe", True, "routed, eager mask", "as BigBird-Pegasus (rel. error 0.5 before)"),
    Architecture("PEGASUS-X", "pegasus_x", True, "routed, eager mask",
                 "its decoder calls tileattn (rel. error 0.7-0.8 on the SDPA mask); its encoder's global-local "
                 "attention is its own, on masks it builds itself (check_model reports it; generate with a static "
                 "cache is judged on the decoder)"),
    Architecture("MiniMax", "minimax", True, "routed",
                 "hybrid: its lightning (linear) attention layers are its own and take no such mask"),
    Architecture("OLMo hybrid", "olmo_hybrid", True, "routed", "hybrid: gated delta (linear) layers of its own"),
    Architecture("GPT-Neo", "gpt_neo", False, "refused", _BY_NAME),
    _FALCON,
    Architecture("BLOOM", "bloom", False, "refused", _MISREAD + "1.0-1.2, also without padding); ALiBi"),
    Architecture("XGLM", "xglm", False, "refused", _MISREAD + "0.8-0.9, also without padding)"),
    Architecture("TrOCR (decoder)", "trocr", False, "refused", _MISREAD + "1.0-1.2, also without padding)"),
    Architecture("GPT-NeoX-Japanese", "gpt_neox_japanese", False, "refused", _MISREAD + "1.3, also without padding)"),
    Architecture("MVP", "mvp", False, "refused", _MISREAD + "1.0-1.2, also without padding)"),
    Architecture("LED", "led", False, "refused", _MISREAD + "0.2-0.8, also without padding)"),
    Architecture("Longformer", "longformer", False, "refused", _MISREAD + "1.3, also without padding)"),
    Architecture("MPT", "mpt", False, "refused", "computes attention itself; crashed on the skipped SDPA mask (None)"),
    Architecture("MPNet", "mpnet", False, "refused", _MISREAD + "0.6 with padding)"),
    Architecture("Megatron-BERT", "megatron-bert", False, "refused", _MISREAD + "0.6 with padding)"),
    Architecture("RoFormer", "roformer", False, "refused", _MISREAD + "0.3 with padding)"),
    Architecture("ConvBERT", "convbert", False, "refused", _MISREAD + "0.25 with padding)"),
    Architecture("RemBERT", "rembert", False, "refused", _MISREAD + "0.5 with padding)"),
    Architecture("SqueezeBERT", "squeezebert", False, "refused", _MISREAD + "0.14 with padding)"),
    Architecture("LUKE", "luke", False, "refused", _MISREAD + "0.27 with padding)"),
    Architecture("CANINE", "canine", False, "refused", "computes attention itself on transformers' mask"),
    Architecture("I-BERT", "ibert", False, "refused", _MISREAD + "1.0 with padding)"),
    Architecture("Nystromformer", "nystromformer", False, "refused", _MISREAD + "0.37 with padding)"),
    Architecture("TAPAS", "tapas", False, "refused", _MISREAD + "0.14 with padding)"),
    Architecture("BigBird", "big_bird", False, "refused", _MISREAD + "0.13 with padding)"),
    Architecture("ImageGPT", "imagegpt", False, "refused", "computes attention itself on transformers' mask"),
    Architecture("XLNet", "xlnet", False, "unaffected", "two-stream attention of its own; never reads the name"),
    Architecture("DeBERTa-v2", "deberta-v2", False, "unaffected", "disentangled attention of its own"),
)


# ---------------------------------------------------------------------------------------------
# Does a module class reach the attention interface?

_ROUTES = {}
_SOFTMAX = {}
_INTERFACE_WORDS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "AttentionInterface")
#: What the code of a module computing softmax attention itself says (linear attention, state-space
#: and gated delta layers, which may be called "...Attention" too, take no attention mask of this kind).
_SOFTMAX_WORDS = re.compile(r"softmax|logsumexp|scaled_dot_product_attention", re.IGNORECASE)


def _own_sources(cls):
    """Source of ``cls`` and of its model-specific base classes (not PreTrainedModel and other
    transformers mixins, which mention the interface without calling it)."""
    for base in cls.__mro__:
        if base is torch.nn.Module:
            break
        if base.__module__.startswith("transformers.") and not base.__module__.startswith("transformers.models."):
            continue
        try:
            yield inspect.getsource(base)
        except (OSError, TypeError):
            continue


def routes(cls) -> Optional[bool]:
    """Whether ``cls`` (its own source or a base class's) looks its attention up in transformers'
    AttentionInterface; None when the source cannot be read."""
    if cls not in _ROUTES:
        found = None
        for source in _own_sources(cls):
            found = bool(found) or any(word in source for word in _INTERFACE_WORDS)
        _ROUTES[cls] = found
    return _ROUTES[cls]


def _softmax(cls) -> bool:
    if cls not in _SOFTMAX:
        _SOFTMAX[cls] = any(_SOFTMAX_WORDS.search(source) for source in _own_sources(cls))
    return _SOFTMAX[cls]


def attention_classes(model) -> tuple:
    """(routed, bypassing): names of the attention module classes of ``model`` (a module, or several)
    that look the implementation up in the interface, and of those that compute softmax attention
    themselves (an ``*Attention*`` module that neither reaches the interface nor holds a module that
    does, and whose code or a submodule's computes a softmax)."""
    routed, bypassing = [], []
    roots = model if isinstance(model, (list, tuple)) else [model]
    for module in dict.fromkeys(m for root in roots for m in root.modules()):
        cls = type(module)
        if routes(cls):
            routed.append(cls.__name__)
        elif "Attention" in cls.__name__ and routes(cls) is False and not any(
                routes(type(m)) for m in module.modules()) and any(_softmax(type(m)) for m in module.modules()):
            bypassing.append(cls.__name__)
    return tuple(dict.fromkeys(routed)), tuple(dict.fromkeys(bypassing))


def _bypassing_in_source(module) -> tuple:
    """Attention classes of a modeling module that never look up the interface, from its source
    (transformers' own heuristic for ``set_attn_implementation``); for a mask built where no model
    can be found."""
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ()
    classes = [c for name, c in vars(module).items() if inspect.isclass(c) and issubclass(c, torch.nn.Module)
               and "Attention" in name and c.__module__ == module.__name__] if source else []
    return tuple(c.__name__ for c in classes if routes(c) is False and _softmax(c))


# ---------------------------------------------------------------------------------------------
# Models that pick their attention class from a table keyed by implementation name.

#: A modeling module of transformers (``transformers.models.falcon.modeling_falcon``).
_MODELING = re.compile(r"transformers\.models\.\w+\.modeling_\w+")


def _add_name(module, names):
    """Give ``names`` the ``"eager"`` class in the module's ``*ATTENTION_CLASSES`` tables (GPT-Neo,
    Falcon, GIT, Bark and the SAM vision towers of OCR models look their attention class up there by
    implementation name, and raise ``KeyError`` for any other): the model builds, and the mask
    builder then judges it like any model that computes attention itself (a language model that
    reads transformers' masks is refused at its first forward; a vision tower that reads none runs
    its own attention, as in eager)."""
    for key, table in vars(module).items():
        if key.endswith("ATTENTION_CLASSES") and isinstance(table, dict) and "eager" in table:
            for name in names:
                table.setdefault(name, table["eager"])


class _NameKeyedTables(importlib.abc.MetaPathFinder):
    """Adds the registered names to those tables of every modeling module imported from now on
    (transformers imports them lazily, when a model class is first used), and of those already
    imported when a name is registered."""

    def __init__(self):
        self.names = []

    def add(self, name):
        if name not in self.names:
            self.names.append(name)
        for module_name, module in list(sys.modules.items()):
            if module is not None and _MODELING.fullmatch(module_name):
                _add_name(module, self.names)

    def find_spec(self, fullname, path, target=None):
        if not _MODELING.fullmatch(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run, names = spec.loader.exec_module, self.names

        def exec_module(module):
            run(module)
            _add_name(module, names)

        spec.loader.exec_module = exec_module
        return spec


_TABLES = _NameKeyedTables()


def name_attention_tables(name: str) -> None:
    """Make ``name`` a key of the implementation-keyed attention-class tables (see :func:`_add_name`)."""
    if _TABLES not in sys.meta_path:
        sys.meta_path.insert(0, _TABLES)
    _TABLES.add(name)


# ---------------------------------------------------------------------------------------------
# The mask builder: the model that builds a mask is judged the first time.


class Verdict(NamedTuple):
    model: str  #: the class of the module that builds the mask
    model_type: str
    bypassing: tuple  #: its attention classes that compute attention themselves
    sdpa: bool  #: whether it declares SDPA support


_VERDICTS = weakref.WeakKeyDictionary()
_STATIC_VERDICTS = {}
_WARNED = set()


def _building_model(config) -> Optional[torch.nn.Module]:
    """The module whose forward (or ``generate``) is building a mask for ``config``: transformers'
    mask functions are called from it with ``config=self.config`` or, in a multimodal model, with the
    config of its language model (``config.get_text_config()``); from the calling frames, None if
    none is found."""
    frame = sys._getframe(2)
    for _ in range(16):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and any(c is config for c in _configs(getattr(owner, "config", None))):
            return owner
        frame = frame.f_back
    return None


def _configs(config) -> list:
    """``config`` and its sub-configs (those of a multimodal model: text, vision, audio...)."""
    seen, todo = [], [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is s for s in seen):
            continue
        seen.append(c)
        todo.extend(getattr(c, key, None) for key in getattr(c, "sub_configs", {}) or {})
    return seen


def mask_readers(model, config) -> list:
    """The modules that read a mask ``model`` builds for ``config``: the sub-models that hold
    ``config`` when it is a sub-config of the model's (a multimodal model's language model; its
    vision and audio towers take masks of their own); the decoder of an encoder-decoder model (what
    it builds above its encoder and decoder is generate's decoder mask, the encoder builds its own);
    else the model. Only their attention classes are judged, so a model is judged on the path the
    mask is for, not on towers or an encoder that never read it."""
    if getattr(model, "config", None) is not config:
        return [m for m in model.modules() if m is not model and getattr(m, "config", None) is config] or [model]
    decoder = model.get_decoder() if getattr(config, "is_encoder_decoder", False) and \
        callable(getattr(model, "get_decoder", None)) else None
    return [decoder] if isinstance(decoder, torch.nn.Module) and decoder is not model else [model]


def verdict(config) -> Verdict:
    """How the model building a mask for ``config`` is to be treated (judged once per model)."""
    model = _building_model(config)
    model_type = getattr(config, "model_type", "") or type(config).__name__
    if model is None:
        key = type(config)
        if key not in _STATIC_VERDICTS:
            module = sys.modules.get(type(config).__module__.replace(".configuration_", ".modeling_"))
            models = [c for c in vars(module).values() if inspect.isclass(c) and hasattr(c, "_supports_sdpa")
                      and c.__module__ == module.__name__] if module is not None else []
            _STATIC_VERDICTS[key] = Verdict(type(config).__name__, model_type, _bypassing_in_source(module),
                                            any(c._supports_sdpa for c in models) if models else True)
        return _STATIC_VERDICTS[key]
    known = _VERDICTS.setdefault(model, {})
    if id(config) not in known:
        _, bypassing = attention_classes(mask_readers(model, config))
        known[id(config)] = Verdict(type(model).__name__, model_type, bypassing,
                                    bool(getattr(model, "_supports_sdpa", True)))
    return known[id(config)]


def bypass_allowed(allow_bypass: Optional[bool]) -> bool:
    if allow_bypass is not None:
        return allow_bypass
    return os.environ.get(ALLOW_BYPASS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


#: The mask each config class got last outside torch.compile ("refuse" > "eager" > "sdpa" when models
#: of one config class differ): what a traced forward, where the model cannot be looked at, builds.
_TRACED_CHOICE = {}
_RANK = {"sdpa": 0, "eager": 1, "refuse": 2}


def _choice(v: Verdict) -> str:
    return "refuse" if v.bypassing else "sdpa" if v.sdpa else "eager"


@torch.compiler.assume_constant_result
def _traced_choice(config_class) -> str:
    return _TRACED_CHOICE.get(config_class, "sdpa")


def refusal(v: Verdict, name: str) -> str:
    other = "attn_implementation='eager'" + (" or 'sdpa'" if v.sdpa else " (it supports no other)")
    verb = "calls" if len(v.bypassing) == 1 else "call"
    return (f"tileattn: {v.model} ('{v.model_type}') computes attention itself ({', '.join(v.bypassing)} never {verb} "
            f"transformers' AttentionInterface): with attn_implementation='{name}' it would not run tileattn, and it "
            f"would read the SDPA-style mask built for '{name}' as its own, giving wrong results. Use {other}. "
            f"To run it anyway on its own attention, with the mask eager builds (exactly eager's results; tileattn "
            f"unused), register with allow_bypass=True or set {ALLOW_BYPASS_ENV}=1.")


def mask_builder(name: str, allow_bypass: Optional[bool], compiling):
    """The mask function registered under ``name``: SDPA's, eager's, or a refusal (see the module doc)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    def tileattn_mask(*args, **kwargs):
        """transformers' SDPA mask for models that call tileattn and declare SDPA support; eager's
        for those that call it without declaring it; an error for those that do not call it."""
        config = kwargs.get("config")
        if config is None:
            return sdpa_mask(*args, **kwargs)
        if compiling():
            choice = _traced_choice(type(config))
            if choice == "refuse" and not bypass_allowed(allow_bypass):
                raise UnsupportedModelError(f"tileattn: a '{getattr(config, 'model_type', '')}' model computes "
                                            "attention itself: see the error of its forward outside torch.compile")
            return sdpa_mask(*args, **kwargs) if choice == "sdpa" else eager_mask(*args, **kwargs)
        v = verdict(config)
        seen = _TRACED_CHOICE.get(type(config), "sdpa")
        _TRACED_CHOICE[type(config)] = max(seen, _choice(v), key=_RANK.get)
        if v.bypassing:
            if not bypass_allowed(allow_bypass):
                raise UnsupportedModelError(refusal(v, name))
            if (v.model, name) not in _WARNED:
                _WARNED.add((v.model, name))
                warnings.warn(f"tileattn: {v.model} ('{v.model_type}') computes attention itself "
                              f"({', '.join(v.bypassing)}): running it on its own attention with eager's mask "
                              f"({ALLOW_BYPASS_ENV} / allow_bypass); tileattn is not used there.", UserWarning,
                              stacklevel=2)
            return eager_mask(*args, **kwargs)
        mask = sdpa_mask(*args, **kwargs) if v.sdpa else eager_mask(*args, **kwargs)
        return mark_padding(mask, kwargs.get("attention_mask"))

    return tileattn_mask


#: The attribute set on a mask built from a 2-d attention mask that hides keys (padding). A
#: PagedCache's reader needs to know: where rows at different lengths share one mask, padding hidden
#: under the window of the longest row looks like that window, and cannot be applied per row.
PADDED = "_tileattn_padded"


def mark_padding(mask, padding):
    if isinstance(mask, torch.Tensor) and isinstance(padding, torch.Tensor) and padding.dim() == 2 and \
            not bool(padding.all()):
        setattr(mask, PADDED, True)
    return mask
