"""``PagedCache``: a Hugging Face ``Cache`` that stores K/V in a paged pool, quantised or not, and that
the ``"tileattn"`` attention implementation reads as stored.

    import tileattn.integrations.transformers as tt
    tt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tileattn")
    cache = tt.PagedCache(model.config, max_batch_size=4, max_cache_len=4096, dtype=torch.int8)
    model.generate(ids, past_key_values=cache, max_new_tokens=64)

Storage, per layer: K and V pools ``(num_pages, page_size, kv_heads, head_dim)`` in the cache's dtype
(``head_dim / 2`` bytes for int4, two values a byte), and for a quantised dtype fp32 scale pools
``(num_pages, page_size, kv_heads, G)``, each stored head-major within a page (a transposed view of
``(num_pages, kv_heads, page_size, ...)``: one head's tokens of a page lie together): per token
(G = 1) for int8 and fp8, per group of ``INT4_GROUP`` channels for int4. :func:`tileattn.serving.store`
quantises each new token into its slot. A block table (``max_batch_size``, pages per sequence) and
the sequences' lengths are shared by the layers; pages are taken from one free list as sequences
grow and given back when they leave.

Reading: ``update`` returns, instead of key and value tensors, a :class:`PagedKV` for the layer,
which the ``"tileattn"`` attention function recognises and reads through one
:func:`tileattn.flash_attention` call on the pools (``block_table``, ``seqused_k``, the scales): no
dequantised copy, no concatenation. Another attention implementation reading it fails naming
PagedCache.

Batch rows are sequences of the cache. ``generate()`` (or a forward on a cache with no selected
sequence) takes the first free ones for its rows; continuous batching selects them itself:
:meth:`PagedCache.add` claims sequences, :meth:`PagedCache.select` says which sequence each row of
the next forwards is, :meth:`PagedCache.release` gives a finished sequence's pages back. Rows may
hold different lengths: each row's queries are the tokens it just wrote, causal at its own end
(bottom right), with each layer's sliding window and chunks applied from the row's own length
(transformers places them from the longest row's; see the notes above :func:`_masks`).

Every argument is checked before anything is written: a wrong dtype, a forward batch that is not the
selected sequences, a sequence that would outgrow ``max_cache_len``, a pool without free pages, more
sequences than ``max_batch_size``, repeated or non-int sequence ids, a model read by another attention
implementation or with more layers than the cache's config raise naming the argument, and the cache
is as it was. MLA models (DeepSeek-V2/V3) are refused at construction.
"""

from __future__ import annotations

import numbers
import sys
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.api import flash_attention
from ..core.kvquant import INT4, INT4_STORAGE
from ..core.modifiers import fail
from ..serving import store
from .transformers_models import PADDED

#: Channels per scale of an int4 cache (llama.cpp's Q4_0 block).
INT4_GROUP = 32
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_QUANTISED = (torch.int8, torch.float8_e4m3fn, INT4)
_INT32_MAX = 2**31 - 1
_DTYPES = "None (the model's dtype), torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn or 'int4'"


class PagedKV:
    """What :meth:`PagedCache.update` returns for a layer, in place of keys and values: the layer's
    pools and the step's block table and lengths, read by the ``"tileattn"`` attention function."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: "PagedCache", layer: "PagedLayer"):
        self.cache, self.layer = cache, layer

    def __getattr__(self, name):
        if name.startswith("__"):  # copy, pickle and friends probing for hooks
            raise AttributeError(name)
        self.cache.abandon()  # the forward that wrote this layer stops here: its tokens are taken out
        raise TypeError(f"tileattn PagedCache: the attention implementation read '{name}' of the cache's keys: a "
                        "PagedCache is read as stored by the 'tileattn' attention implementation only; load the "
                        "model with attn_implementation='tileattn' (tileattn.integrations.transformers.register()). "
                        "The forward's tokens were taken out of the cache again.")


class PagedLayer(CacheLayerMixin):
    """One layer's pools; the step (which slots the new tokens go to) is the cache's."""

    is_compileable = True
    is_sliding = False

    def __init__(self, cache: "PagedCache", window: Optional[int] = None, chunk: Optional[int] = None):
        super().__init__()
        self.cache = cache
        # the layer's sliding window and attention chunk (Llama-4), from the config as transformers
        # builds the layer's mask from it; applied per row by the reader
        self.window, self.chunk = window, chunk
        self.k_scale = self.v_scale = None
        self.read = PagedKV(cache, self)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate every layer's pools (the first layer's call): a pool too large for the device then
        fails before the forward writes anything, naming the sizes."""
        cache = self.cache
        stored = cache.storage_dtype(key_states.dtype)
        cache.check_states(key_states, value_states)
        width = cache.head_dim // 2 if cache.dtype == INT4 else cache.head_dim
        device = key_states.device

        def pool(last, dtype):
            # stored head-major within a page (a head's keys of a page are contiguous, which the decode
            # kernel streams), seen as the (pages, page_size, kv heads, last) pool flash_attention reads
            return torch.zeros(cache.num_pages, cache.heads_kv, cache.page_size, last, dtype=dtype,
                               device=device).transpose(1, 2)

        groups = cache.head_dim // INT4_GROUP if cache.dtype == INT4 else 1
        layers = [layer for layer in cache.layers if not layer.is_initialized]
        try:
            for layer in layers:
                layer.keys, layer.values = pool(width, stored), pool(width, stored)
                if cache.dtype in _QUANTISED:
                    layer.k_scale, layer.v_scale = pool(groups, torch.float32), pool(groups, torch.float32)
        except (RuntimeError, MemoryError) as exc:
            for layer in layers:
                layer.keys = layer.values = layer.k_scale = layer.v_scale = None
            fail(ValueError, "num_pages", f"{cache.num_pages} pages of {cache.page_size} tokens x {cache.heads_kv} "
                 f"kv heads x {width} ({stored}) per layer, K and V, {len(layers)} layers, which {device} could not "
                 f"allocate ({type(exc).__name__})", "fewer pages, a smaller page_size or max_cache_len, or a "
                 "narrower dtype")
        cache.place(device)
        for layer in layers:
            layer.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("tileattn PagedCache: layers are updated through PagedCache.update")

    def get_mask_sizes(self, query_length: int):
        return self.cache.capacity, 0

    def get_seq_length(self):
        return self.cache.get_seq_length(self.cache.layers.index(self))

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def reset(self) -> None:
        self.cache.reset()

    def reorder_cache(self, beam_idx) -> None:
        self.cache.reorder_cache(beam_idx)

    def offload(self):
        raise NotImplementedError("tileattn PagedCache keeps its pools on their device (no offloading)")

    prefetch = offload

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.k_scale, self.v_scale)
                   if t is not None)


class PagedCache(Cache):
    """A paged, optionally quantised K/V cache for Hugging Face models (module docstring).

    Args:
        config: the model's config (its text config for a multimodal model): layers, kv heads, head dim.
        max_batch_size: the most sequences the cache holds at once.
        max_cache_len: the most tokens one sequence holds.
        dtype: None (the model's dtype), torch.bfloat16, torch.float16, torch.int8 (per-token scales),
            torch.float8_e4m3fn (per-token scales) or "int4" (per-group scales, ``INT4_GROUP`` channels).
        page_size: tokens per page.
        num_pages: pages in the pool, shared by the sequences; default enough for every sequence to
            reach ``max_cache_len`` (``max_batch_size * ceil(max_cache_len / page_size)``).
    """

    def __init__(self, config, *, max_batch_size: int, max_cache_len: int, dtype=None, page_size: int = 16,
                 num_pages: Optional[int] = None):
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len),
                            ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(ValueError, name, repr(value), "a positive int")
        if dtype is not None and dtype not in _FLOATS[1:] + _QUANTISED:
            fail(TypeError, "dtype", repr(dtype), _DTYPES)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        if not isinstance(heads, int) or not hasattr(text, "num_hidden_layers"):
            fail(TypeError, "config", type(config).__name__,
                 "a decoder config with num_hidden_layers and num_attention_heads")
        types = list(getattr(text, "layer_types", None) or [])[:text.num_hidden_layers]
        types += ["full_attention"] * (text.num_hidden_layers - len(types))
        other = sorted({t for t in types if t not in ("full_attention", "sliding_attention", "chunked_attention")})
        if other:
            fail(ValueError, "config", f"layer types {other}", "attention layers only (full, sliding or chunked)")
        if getattr(text, "kv_lora_rank", None) is not None:
            fail(ValueError, "config", f"{type(text).__name__}, multi-head latent attention (MLA: kv_lora_rank "
                 f"{text.kv_lora_rank}, key head dim {getattr(text, 'qk_head_dim', '?')}, value head dim "
                 f"{getattr(text, 'v_head_dim', '?')})", "a model with one key and value head dim: PagedCache does not "
                 "support MLA (DeepSeek-V2/V3 and their kin); use a DynamicCache or StaticCache for it")
        self.heads_kv = getattr(text, "num_key_value_heads", None) or heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if dtype == INT4 and self.head_dim % INT4_GROUP:
            fail(ValueError, "dtype", f"'int4' for head dim {self.head_dim}",
                 f"a head dim that is a multiple of {INT4_GROUP} (the int4 group), or another dtype")
        self.dtype, self.page_size, self.max_cache_len = dtype, page_size, max_cache_len
        self.max_batch_size = max_batch_size
        self.pages_per_sequence = -(-max_cache_len // page_size)
        self.capacity = self.pages_per_sequence * page_size
        pages = num_pages
        if num_pages is None:
            num_pages = max_batch_size * self.pages_per_sequence
            pages = (f"None, by default max_batch_size x pages per sequence = {max_batch_size} x "
                     f"{self.pages_per_sequence} = {num_pages}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            fail(ValueError, "num_pages", repr(num_pages), "a positive int (pages in the pool)")
        # lengths, page indices and the mask's width are int32 for the kernels
        slots = f"{max_cache_len} ({self.capacity} slots in pages of {page_size})"
        for name, value, given in (("max_cache_len", self.capacity, slots), ("max_batch_size", max_batch_size,
                                   max_batch_size), ("num_pages", num_pages, pages)):
            if value > _INT32_MAX:
                fail(ValueError, name, given, f"at most {_INT32_MAX} (int32 lengths and page indices)"
                     + ("; pass num_pages, or a smaller max_batch_size or max_cache_len" if given is pages and
                        pages != num_pages else ""))
        self.num_pages = num_pages
        self.model_dtype = None
        chunk = getattr(text, "attention_chunk_size", None)
        # without layer types, models window every layer when the config has a window (Mistral, Phi-3...)
        window = getattr(text, "sliding_window", None) or None
        windowed = ("sliding_attention",) if getattr(text, "layer_types", None) else ("full_attention",)
        super().__init__(layers=[PagedLayer(self, window if t in windowed else None,
                                            chunk if t == "chunked_attention" else None) for t in types])
        # The state is tensors (so that a compiled forward reads and advances it): the block table,
        # each sequence's length and page count, the free pages (a stack: the first free_count[0]
        # entries) and the selected rows. Which sequences are claimed is the host's (add/release).
        try:
            self.block_table = torch.zeros(max_batch_size, self.pages_per_sequence, dtype=torch.int32)
            self.seq_lengths = torch.zeros(max_batch_size, dtype=torch.int32)
            self.pages_held = torch.zeros(max_batch_size, dtype=torch.int32)
            self._claimed = [False] * max_batch_size
        except (RuntimeError, MemoryError) as exc:
            fail(ValueError, "max_batch_size", f"{max_batch_size} sequences of {self.pages_per_sequence} pages, whose "
                 f"block table could not be allocated ({type(exc).__name__})",
                 "fewer sequences, or a smaller max_cache_len or larger page_size (fewer pages per sequence)")
        try:
            self.free_pages = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32)
        except (RuntimeError, MemoryError) as exc:
            fail(ValueError, "num_pages", f"{pages}, whose free list could not be allocated ({type(exc).__name__})",
                 "fewer pages")
        self.free_count = torch.tensor([num_pages], dtype=torch.int64)
        self.rows = torch.zeros(0, dtype=torch.int64)
        self.device = None
        # (slots, lengths, block table, host lengths or None while compiling) of the selected rows for this forward
        self._step = None
        self._taken = None  # what this forward changed, to take it out again (abandon)
        self._written, self._q_len = -1, 0  # the last layer this forward wrote, and its tokens per row
        self._masks = {}  # this forward's mask readings (_positional, _chunks)

    # ------------------------------------------------------------------------------------ storage

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The pools' dtype for a model computing in ``model_dtype`` (the first keys seen)."""
        if self.model_dtype is None:
            self.model_dtype = model_dtype
        if self.dtype is None:
            return model_dtype
        return INT4_STORAGE if self.dtype == INT4 else self.dtype

    def check_states(self, key_states, value_states) -> None:
        expected = f"(batch, {self.heads_kv}, tokens, {self.head_dim}) floats, the config's kv heads and head dim"
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point() or \
                    t.shape[1] != self.heads_kv or t.shape[3] != self.head_dim:
                fail(ValueError, name, getattr(t, "shape", type(t).__name__), expected)
        if value_states.shape != key_states.shape:
            fail(ValueError, "value_states", f"shape {tuple(value_states.shape)}",
                 f"the shape of key_states {tuple(key_states.shape)}")

    def place(self, device) -> None:
        """Move the state to the pools' device (once, when the first layer is allocated)."""
        if self.device is None:
            self.device = device
            for name in ("block_table", "seq_lengths", "pages_held", "free_pages", "free_count", "rows"):
                setattr(self, name, getattr(self, name).to(device))

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage: every layer's pools and scale pools (0 before the first forward)."""
        return sum(layer.nbytes for layer in self.layers if layer.is_initialized)

    # ---------------------------------------------------------------------------------- sequences

    def add(self, count: int = 1) -> List[int]:
        """Claim ``count`` free sequences (empty, no page yet); returns their ids."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            fail(ValueError, "count", repr(count), "a positive int")
        free = [s for s in range(self.max_batch_size) if not self._claimed[s]]
        if len(free) < count:
            fail(ValueError, "max_batch_size", self.max_batch_size,
                 f"room for {count} more sequences ({self.max_batch_size - len(free)} held): release finished ones")
        for s in free[:count]:
            self._claimed[s] = True
        return free[:count]

    def select(self, sequences: Sequence[int]) -> None:
        """The sequences the rows of the next forwards are (row i is ``sequences[i]``)."""
        rows = self._sequence_list("sequences", sequences)
        self.rows = torch.tensor(rows, dtype=torch.int64, device=self.device)

    def release(self, sequences: Sequence[int]) -> None:
        """Give the sequences' pages back to the pool; they leave the selection and may be claimed again."""
        rows = self._sequence_list("sequences", sequences)
        top = int(self.free_count[0])
        for s in rows:
            n = int(self.pages_held[s])
            self.free_pages[top:top + n] = self.block_table[s, :n].flip(0)
            top += n
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.free_count[0] = top
        self.seq_lengths[index] = 0
        self.pages_held[index] = 0
        for s in rows:
            self._claimed[s] = False
        kept = [r for r in self.rows.tolist() if r not in rows]
        self.rows = torch.tensor(kept, dtype=torch.int64, device=self.device)

    def _sequence_list(self, name, sequences) -> List[int]:
        """The ids, checked before anything changes: ints (no bool, float or str, which int() would
        take), claimed, each once (a sequence released twice would put its pages on the free list
        twice, and two sequences would then share them)."""
        expected = f"a list of distinct int sequence ids from add() (held: {self.sequences})"
        if isinstance(sequences, torch.Tensor):
            if sequences.dim() != 1 or sequences.is_floating_point() or sequences.is_complex() or \
                    sequences.dtype == torch.bool:
                fail(TypeError, name, f"a {sequences.dtype} tensor of shape {tuple(sequences.shape)}", expected)
            sequences = sequences.tolist()
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            fail(TypeError, name, repr(sequences), expected)
        rows = list(sequences)
        for s in rows:
            if isinstance(s, bool) or not isinstance(s, numbers.Integral):
                fail(TypeError, name, f"{s!r} ({type(s).__name__}) among {rows!r}", expected)
        rows = [int(s) for s in rows]
        bad = [s for s in rows if not 0 <= s < self.max_batch_size or not self._claimed[s]]
        if bad:
            fail(ValueError, name, f"sequence {bad[0]}", expected)
        if len(set(rows)) != len(rows):
            twice = next(s for i, s in enumerate(rows) if s in rows[:i])
            fail(ValueError, name, f"{rows} (sequence {twice} more than once)", expected)
        return rows

    @property
    def sequences(self) -> List[int]:
        """The claimed sequences."""
        return [s for s in range(self.max_batch_size) if self._claimed[s]]

    def lengths(self) -> List[int]:
        """Tokens held by each selected row's sequence."""
        return self.seq_lengths[self.rows].tolist()

    # ------------------------------------------------------------------------------------ updates

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0 and not torch.compiler.is_compiling():
            self._check_caller(sys._getframe(1).f_locals.get("self"))
        if not 0 <= layer_idx < len(self.layers):
            self.abandon()
            fail(ValueError, "layer_idx", f"{layer_idx}, from a model with more layers than the config the cache was "
                 f"built from ({len(self.layers)} layers; the forward's tokens were taken out again)",
                 "a PagedCache built from the model's own config (model.config)")
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if layer_idx == 0:
            self._advance(key_states, value_states)
        elif self._step is None:
            fail(ValueError, "layer_idx", layer_idx, "0 first: a forward writes every layer in order")
        slots = self._step[0]
        for pool, scales, new in ((layer.keys, layer.k_scale, key_states), (layer.values, layer.v_scale, value_states)):
            tokens = new.transpose(1, 2).reshape(-1, new.shape[1], new.shape[3])
            if torch.compiler.is_compiling():
                paged_store(pool, scales, slots, tokens)
            else:
                store(pool, slots, tokens, scale_cache=scales)
        self._written = layer_idx
        return layer.read, layer.read

    def _check_caller(self, module) -> None:
        """Refuse a forward before it writes anything when the attention module calling ``update`` (a
        transformers attention module holds its config) will not read the cache as stored (eager or
        another of transformers' implementations), or belongs to a model with more layers than the
        cache. What this cannot see (a module without a config, an implementation of the caller's own)
        is refused when the layer is read or past the last layer, and the forward's tokens are then
        taken out again (:meth:`abandon`)."""
        config = getattr(module, "config", None) if isinstance(module, torch.nn.Module) else None
        if config is None:
            return
        implementation = getattr(config, "_attn_implementation", None)
        if isinstance(implementation, str):
            from transformers import AttentionInterface

            # transformers' own implementations read K/V as tensors; tileattn's lives in tileattn's module
            function = AttentionInterface().get(implementation)
            if function is None or getattr(function, "__module__", "").startswith("transformers"):
                fail(TypeError, "attn_implementation", f"'{implementation}' ({type(module).__name__}), which reads "
                     "keys and values as tensors: nothing was written to the cache",
                     "attn_implementation='tileattn' (tileattn.integrations.transformers.register()): a PagedCache is "
                     "read as stored by the 'tileattn' attention implementation only")
        layers = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, int) and not isinstance(layers, bool) and layers > len(self.layers):
            fail(ValueError, "config", f"a PagedCache built from a config of {len(self.layers)} layers, for a model "
                 f"of {layers} layers ({type(module).__name__}): nothing was written to the cache",
                 "a PagedCache built from the model's own config (PagedCache(model.config, ...))")

    def _advance(self, key_states, value_states) -> None:
        """A new forward: check it, take pages, and lay out where its tokens go (nothing changes
        unless every check passes)."""
        self.check_states(key_states, value_states)
        batch, q_len = key_states.shape[0], key_states.shape[2]
        self._q_len = q_len
        compiling = torch.compiler.is_compiling()
        claimed = []
        if self.rows.numel() == 0 and not compiling:
            claimed = self.add(batch)  # generate(): the batch's rows take free sequences
            self.select(claimed)
        if batch != self.rows.shape[0]:
            fail(ValueError, "key_states", f"a batch of {batch} rows",
                 f"{self.rows.shape[0]}, the selected sequences (select() them)")
        if compiling:
            self._taken = None
            self._step = (*paged_advance(self.block_table, self.seq_lengths, self.pages_held, self.free_pages,
                                         self.free_count, self.rows, q_len, self.page_size, self.max_cache_len), None)
            return
        try:
            *step, taken = _take(self.block_table, self.seq_lengths, self.pages_held, self.free_pages, self.free_count,
                                 self.rows, q_len, self.page_size, self.max_cache_len)
        except BaseException:
            if claimed:
                self.release(claimed)
            raise
        self._step, self._taken = tuple(step), (claimed, taken)
        self._masks.clear()

    def abandon(self) -> None:
        """Take the last forward's tokens out again: its sequences' lengths and pages as they were
        before it, the sequences it claimed released (the bytes it wrote stay, in slots no sequence
        holds). Called when a forward is refused once layers were written; nothing while compiling."""
        if self._taken is None:
            return
        claimed, (index, before, held, top, writes) = self._taken
        self._taken = self._step = None
        rows = torch.tensor(index, dtype=torch.int64, device=self.device)
        self.seq_lengths[rows] = torch.tensor(before, dtype=torch.int32, device=self.device)
        self.pages_held[rows] = torch.tensor(held, dtype=torch.int32, device=self.device)
        self.free_count[0] = top
        for s, h, old in writes:
            self.block_table[s, h:h + old.numel()] = old
        if claimed:
            self.release(claimed)

    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value) -> None:
        # generate() marks the cache it was given before its first forward: the moment to refuse the
        # modes that would reorder or crop it after the prefill wrote (read from the marking frame)
        caller = sys._getframe(1).f_locals
        config = caller.get("generation_config")
        mode = getattr(caller.get("generation_mode"), "value", None)
        beams = getattr(config, "num_beams", None) or 1
        if beams > 1:
            name, given = "num_beams", f"{beams} beams"
        elif mode == "assisted_generation":
            lookup = getattr(config, "prompt_lookup_num_tokens", None)
            name = "prompt_lookup_num_tokens" if lookup else "assistant_model"
            given = "assisted generation"
        else:
            name = None
        if name is not None:
            fail(NotImplementedError, name, given, "greedy decoding or sampling: a PagedCache does not reorder or crop "
                 "sequences (beam search, assisted decoding); use a DynamicCache for them (nothing was written)")
        self.__dict__["_user_defined"] = value

    # ------------------------------------------------------------------------- transformers' Cache

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens held by the longest selected sequence (transformers places new positions after it)
        in layer ``layer_idx``: a layer the forward in progress has not written yet holds the tokens
        from before it, as a DynamicCache's layer does (the lengths are shared, and advanced by layer
        0's write; Llama-4's layers without RoPE take their query temperature from this). A 0-d
        tensor while torch.compile traces (as a StaticCache's), else an int."""
        ahead = self._q_len if layer_idx > 0 and self._step is not None and layer_idx > self._written else 0
        if torch.compiler.is_compiling():
            return self.seq_lengths[self.rows].amax() - ahead
        return int(self.seq_lengths[self.rows].max()) - ahead if self.rows.numel() else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.capacity, 0

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Release every sequence (the pools keep their memory)."""
        self.release(self.sequences)
        self._step = self._taken = None

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("tileattn PagedCache does not reorder sequences (beam search): use greedy or "
                                  "sampling, or a DynamicCache. The cache holds what was written before this call; "
                                  "reset() it (or release() the rows) to reuse it")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("tileattn PagedCache does not crop (assisted decoding): use a DynamicCache. The "
                                  "cache holds what was written before this call; reset() it to reuse it")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("tileattn PagedCache does not repeat sequences: give each row its own prompt")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("tileattn PagedCache: use select()/release() to change the batch")

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]


# ------------------------------------------------------------------------------ the step, as ops
# A compiled forward calls these as custom ops (opaque nodes: they read values to take pages and to
# check the new tokens); an eager one calls the functions directly.


def _take(block_table, seq_lengths, pages_held, free_pages, free_count, rows, q_len: int, page_size: int,
          max_cache_len: int):
    """Take the pages the rows' next ``q_len`` tokens need and advance their lengths; returns the
    tokens' flat slots (rows * q_len,), the rows' new lengths (int32), their block table rows, the new
    lengths as a list, and what :meth:`PagedCache.abandon` needs to take the step out again.
    Checked first: nothing changes when a sequence would outgrow ``max_cache_len`` or the pool
    has too few free pages."""
    index = rows.tolist()
    before = seq_lengths[rows]
    lengths = before.tolist()
    held = pages_held[rows].tolist()
    need = []
    for s, length, h in zip(index, lengths, held):
        if length + q_len > max_cache_len:
            fail(ValueError, "max_cache_len", max_cache_len,
                 f"room for {q_len} more tokens of sequence {s}, which holds {length}")
        need.append(-(-(length + q_len) // page_size) - h)
    top = first = int(free_count[0])
    if sum(need) > top:
        fail(ValueError, "num_pages", free_pages.numel(),
             f"{sum(need)} free pages for this forward ({top} free): release finished sequences")
    writes = []
    for s, h, n in zip(index, held, need):
        if n:
            writes.append((s, h, block_table[s, h:h + n].clone()))
            block_table[s, h:h + n] = free_pages[top - n:top].flip(0)
            top -= n
    free_count[0] = top
    pages_held[rows] += torch.tensor(need, dtype=torch.int32, device=rows.device)
    seq_lengths[rows] += q_len
    table = block_table[rows]
    positions = before.long()[:, None] + torch.arange(q_len, device=rows.device)
    slots = table.long().gather(1, positions // page_size) * page_size + positions % page_size
    return (slots.flatten(), seq_lengths[rows], table, [n + q_len for n in lengths],
            (index, lengths, held, first, writes))


@torch.library.custom_op("tileattn::paged_cache_advance",
                         mutates_args=("block_table", "seq_lengths", "pages_held", "free_pages", "free_count"))
def paged_advance(block_table: torch.Tensor, seq_lengths: torch.Tensor, pages_held: torch.Tensor,
                  free_pages: torch.Tensor, free_count: torch.Tensor, rows: torch.Tensor, q_len: int, page_size: int,
                  max_cache_len: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _take(block_table, seq_lengths, pages_held, free_pages, free_count, rows, q_len, page_size,
                 max_cache_len)[:3]


@paged_advance.register_fake
def _(block_table, seq_lengths, pages_held, free_pages, free_count, rows, q_len, page_size, max_cache_len):
    batch = rows.shape[0]
    return (rows.new_empty((batch * q_len,)), seq_lengths.new_empty((batch,)),
            block_table.new_empty((batch, block_table.shape[1])))


@torch.library.custom_op("tileattn::paged_cache_store", mutates_args=("pool", "scales"))
def paged_store(pool: torch.Tensor, scales: Optional[torch.Tensor], slots: torch.Tensor, new: torch.Tensor) -> None:
    store(pool, slots, new, scale_cache=scales)


@paged_store.register_fake
def _(pool, scales, slots, new):
    return None


# ------------------------------------------------------------------------------------------ reading


def paged_attention(kv: PagedKV, query, attention_mask, *, scaling, softcap, sinks, sliding_window=None):
    """The attention of ``query`` (B, H, q_len, D) over the layer's pools as stored: ``(out (B, q_len, H, D),
    None)``. ``attention_mask``: transformers' bool (or additive) mask over the cache's capacity, or None;
    ``sliding_window``: the window the model passed (flash-attn's reading), for a layer whose config
    gave the cache none; the config's wins, as transformers builds the mask from it."""
    cache, layer = kv.cache, kv.layer
    window = layer.window if layer.window is not None else sliding_window
    _, used, table, lengths = cache._step
    q_len = query.shape[2]
    if lengths is None:
        mask, bias, window = _traced_masks(cache, attention_mask, used, q_len, window, layer.chunk)
    else:
        mask, bias, window = _masks(cache, attention_mask, lengths, used, q_len, window, layer.chunk)
    if bias is not None:
        bias = bias.to(query.dtype)
    q = query.transpose(1, 2)
    if layer.keys.dtype in _FLOATS and layer.keys.dtype != q.dtype:
        q = q.to(layer.keys.dtype)  # a bf16/fp16 cache under an fp32 model: attention in the cache's dtype
    out = flash_attention(q, layer.keys, layer.values, layout="BSND", block_table=table, seqused_k=used, causal=True,
                          window=window, scale=scaling, softcap=softcap, mask=mask, bias=bias, sinks=sinks,
                          k_scale=layer.k_scale, v_scale=layer.v_scale)
    return out.to(query.dtype), None


# Rows at different lengths: transformers builds one mask for the batch, its causal part, window and
# chunks placed from the longest row's position. Causality is applied per row by the kernel (each
# row bottom-right at its own length), and so are the window (``window=``) and the chunks (a mask
# built from each row's length). What transformers' mask adds beyond that pattern (padding, a
# caller's 4-d mask) is indexed by key slot, the same for every row, and applied as given; but on a
# windowed or chunked layer it cannot be told apart from the longest row's pattern for the other
# rows, so rows at different lengths with such a mask are refused there.


def _masks(cache, mask, lengths, used, q_len, window, chunk):
    """(mask, bias, window) for flash_attention in eager mode (``lengths``: the rows' lengths, host)."""
    top = max(lengths)
    in_step = min(lengths) == top
    if mask is None or ((q_len == 1 or not in_step) and not getattr(mask, PADDED, False) and
                        _positional(cache, mask, top, q_len, window, chunk)):
        # the pattern alone: every row's own, applied by the kernel (mask-free when no chunk)
        return _chunks(cache, used, q_len, chunk), None, None if window is None else (window - 1, 0)
    if in_step or (window is None and chunk is None):
        # rows in step: the mask is each row's; on a full layer, the longest row's causal part hides
        # nothing the row's own does not, and the rest is per key slot
        return (mask, None, None) if mask.dtype == torch.bool else (None, mask, None)
    cache.abandon()
    kind = f"window {window}" if window is not None else f"chunks of {chunk}"
    what = "padding" if getattr(mask, PADDED, False) else "a mask hiding keys beyond the layer's pattern"
    fail(ValueError, "attention_mask", f"{what}, on a layer with {kind}, for rows at different lengths {lengths}: "
         "transformers placed the pattern from the longest row (the forward's tokens were taken out again)",
         "no attention_mask (or one of ones) for rows at different lengths: their causality, window and chunks are "
         "applied per row; padding or a 4-d mask only with rows at one length")


def _positional(cache, mask, top, q_len, window, chunk) -> bool:
    """Whether ``mask`` hides exactly what transformers' pattern of the layer (causal, and the window
    or the chunks) hides for the longest row, on the keys the rows hold: then nothing else is in it.
    Read once per forward (the readings are dropped when the next one starts, so a mask edited in
    place between forwards is read again), keyed on the mask's version counter and data as well as
    the object: an edit within the forward is read again too. An inference tensor has no version
    counter; one cannot be edited while the forward that reads it runs."""
    version = None if mask.is_inference() else mask._version
    key = (id(mask), version, mask.data_ptr(), top, q_len, window, chunk)
    seen = cache._masks.get(key)
    if seen is not None and seen[0] is mask:
        return seen[1]
    found = mask.dim() == 4 and mask.shape[-2] == q_len and mask.shape[-1] >= top
    if found:
        visible = mask[..., :top] if mask.dtype == torch.bool else mask[..., :top] == 0
        found = bool((visible == _pattern(top, q_len, window, chunk, mask.device)).all())
    cache._masks[key] = (mask, found)
    return found


def _pattern(top, q_len, window, chunk, device) -> torch.Tensor:
    """(q_len, top) bool: what transformers' causal, sliding or chunked mask lets the queries of a row
    of ``top`` keys see (the queries at positions top - q_len ...)."""
    position = torch.arange(top - q_len, top, device=device)[:, None]
    key = torch.arange(top, device=device)
    keep = key <= position
    if window is not None:
        keep &= key > position - window
    if chunk is not None:
        keep &= key // chunk == position // chunk
    return keep


def _chunks(cache, used, q_len, chunk):
    """(B, 1, q_len, capacity) bool: each row's queries see the keys of their own chunk, counted from
    the row's length (``used``); None on a layer without chunks, or when every key is in the first.
    Built once per forward (outside torch.compile, where it is a few ops of the graph)."""
    compiling = torch.compiler.is_compiling()
    if chunk is None or (not compiling and int(used.max()) <= chunk):
        return None
    key = ("chunks", chunk)
    if compiling or key not in cache._masks:
        position = used.long()[:, None] - q_len + torch.arange(q_len, device=used.device)
        keys = torch.arange(cache.capacity, device=used.device)
        chunks = (keys // chunk == (position // chunk)[..., None]).unsqueeze(1)
        if compiling:
            return chunks
        cache._masks[key] = chunks
    return cache._masks[key]


def _traced_masks(cache, mask, used, q_len, window, chunk):
    """(mask, bias, window) inside torch.compile, where no value can be read: rows shorter than the
    longest drop transformers' mask on a windowed or chunked layer (whose pattern the kernel and the
    chunk mask apply per row): exact without padding; padding is then honoured for rows in step only."""
    native = None if window is None else (window - 1, 0)
    if window is None and chunk is None:
        return (mask, None, None) if mask is None or mask.dtype == torch.bool else (None, mask, None)
    shorter = (used < used.amax()).view(-1, 1, 1, 1)
    chunks = _chunks(cache, used, q_len, chunk)
    if mask is None:
        return chunks, None, native
    if mask.dtype != torch.bool:  # an additive mask: dropped for the shorter rows, chunks for them only
        return None if chunks is None else chunks | ~shorter, mask.masked_fill(shorter, 0), native
    return torch.where(shorter, True if chunks is None else chunks, mask), None, native
