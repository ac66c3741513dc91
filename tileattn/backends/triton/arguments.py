"""The Triton kernels' arguments, in named groups.

A kernel takes the tensors of its problem as plain pointers (the autotuner keys on their dtypes) and
everything else in a few groups: Python ``NamedTuple``s, which Triton passes as tuples (each field
specialised as a scalar argument of its own would be) and the kernels read by field name. Each tensor
has its :class:`Strides`; a call has its :class:`ModifierTensors`, :class:`Sequences`, :class:`Sizes`,
:class:`Scalars` and :class:`Flags`, the one constexpr group (a kernel is compiled per combination).
The launcher builds them once per call (:func:`tileattn.backends.triton.launch._common`), taking
``ModifierTensors``, ``Scalars`` and the ``HAS_*`` flags from the kernel arguments of their names. Two
more groups are made inside the kernels, by :mod:`.tile_math`'s prologue: a program's
:class:`Sequence` and :class:`ScoreHead`.

Plain Python (no ``@triton.jit``), so the launcher imports it before the kernels are decorated.
"""

from typing import NamedTuple


class Strides(NamedTuple):
    """A tensor's strides along its canonical (batch, head, row, column) dims: for a mask or bias
    (batch, head, query, key), 0 along the dims it broadcasts over; 0 for a dim it does not have."""

    b: int
    h: int
    s: int
    d: int


class ModifierStrides(NamedTuple):
    """The strides of :class:`ModifierTensors`' tensors, by the same names (zeros for those a call has
    not)."""

    mask: Strides
    bias: Strides
    alibi_slopes: Strides


class ModifierTensors(NamedTuple):
    """The call's per-call tensors the kernels read, each the kernel argument of its name
    (:class:`tileattn.core.kernel_args.KernelArgs`; a one-element dummy where the call has none, a bool
    mask as uint8), and their strides along (batch, head, query, key), 0 where they broadcast. A new
    tensor kernel argument is a field here and in :class:`ModifierStrides`; :func:`.tile_math.head_scores`
    reads it."""

    mask: object
    bias: object
    alibi_slopes: object
    st: ModifierStrides


class Sequences(NamedTuple):
    """Where each sequence's rows are: int32 packed offsets of queries and keys, keys in use per
    sequence, a paged cache's block table (its row stride and page size); dummies where absent."""

    cu_q: object
    cu_k: object
    used_k: object
    table: object
    table_stride: int
    page_size: int


class Sizes(NamedTuple):
    seqlen_q: int
    seqlen_k: int
    group: int  # query heads per kv head
    head_dim: int
    head_dim_v: int


class Scalars(NamedTuple):
    """The call's kernel arguments (:class:`tileattn.core.kernel_args.KernelArgs`) as numbers: the
    softmax scale, the softcap (1 without), the band sides (0 where unbounded: see :class:`Flags`),
    the alignment shift, the dropout threshold and the scale of the kept weights."""

    scale: float
    softcap: float
    left: int
    right: int
    shift: int
    drop_threshold: int
    drop_scale: float


class Flags(NamedTuple):
    """What a call has, as compile-time constants."""

    HAS_LEFT: bool
    HAS_RIGHT: bool
    BOTTOM_RIGHT: bool
    IS_VARLEN: bool
    HAS_MASK: bool
    HAS_BIAS: bool
    HAS_ALIBI_SLOPES: bool
    HAS_SOFTCAP: bool
    HAS_DROPOUT: bool
    HAS_SEQUSED: bool
    PAGED: bool


class Sequence(NamedTuple):
    """A program's sequence (made inside the kernels): its first query and key rows, lengths and
    diagonal offset."""

    q_start: object
    q_len: object
    k_start: object
    k_len: object
    offset: object


class ScoreHead(NamedTuple):
    """What :func:`score_tile` reads of one (sequence, query head) (made inside the kernels): the
    diagonal, the lengths, the ALiBi slope, the mask's and the bias's rows of the head and their
    strides, the dropout key."""

    offset: object
    q_len: object
    k_len: object
    slope: object
    mask: object
    bias: object
    mask_st: Strides
    bias_st: Strides
    drop_key: object
