"""llama.cpp's q8_0 / q4_0 blocks as a K/V cache: written by tileattn.serving.quantise, read as stored
(k_format / v_format), checked against a decoding of ggml's byte layout written here, independent of
the library, and the fp64 reference on those values."""

import struct

import pytest
import torch

import tileattn
from tileattn.core.dispatch import list_backends
from tileattn.core.kvformat import DEFAULTS, FORMATS, KVFormat
from tileattn.core.kvquant import KVQuant
from tileattn.serving import quantise

BLOCKS = ("q8_0", "q4_0")


def ggml_decode(stored: torch.Tensor, name: str) -> torch.Tensor:
    """ggml's layout, byte by byte: per 32 values a little-endian fp16 d, then 32 int8 (q8_0: d * q) or
    16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31 (q4_0: d * (nibble - 8))."""
    size = 34 if name == "q8_0" else 18
    rows = stored.reshape(-1, stored.shape[-1]).tolist()
    out = []
    for row in rows:
        values = []
        for b0 in range(0, len(row), size):
            block = bytes(row[b0:b0 + size])
            d = struct.unpack("<e", block[:2])[0]
            if name == "q8_0":
                values += [d * q for q in struct.unpack("<32b", block[2:])]
            else:
                body = block[2:]
                values += [d * ((x & 15) - 8) for x in body] + [d * ((x >> 4) - 8) for x in body]
        out.append(values)
    width = stored.shape[-1] // size * 32
    return torch.tensor(out, dtype=torch.float64).reshape(*stored.shape[:-1], width)


# ------------------------------------------------------------------------------------------ formats


def test_the_registry_names_every_format_and_the_dtypes_keep_their_defaults():
    assert set(FORMATS) == {"int8", "e4m3", "e5m2", "int4", "q8_0", "q4_0"}
    assert {d: f.name for d, f in DEFAULTS.items()} == {torch.int8: "int8", torch.float8_e4m3fn: "e4m3",
                                                        torch.float8_e5m2: "e5m2", torch.uint8: "int4"}
    q8, q4 = FORMATS["q8_0"], FORMATS["q4_0"]
    assert isinstance(q8, KVFormat) and (q8.block, q8.block_bytes, q8.scales, q8.scale_dtype) == \
        (32, 34, "inside", torch.float16)
    assert (q4.block, q4.block_bytes, q4.row_size(128), q4.width(72)) == (32, 18, 72, 128)
    with pytest.raises(Exception):
        q8.name = "other"  # frozen


def test_a_handmade_block_reads_as_ggml_lays_it_out():
    d = struct.pack("<e", 0.5)
    q8 = torch.tensor(list(d) + [x & 255 for x in range(-16, 16)], dtype=torch.uint8)
    assert FORMATS["q8_0"].decode(q8, torch.float64).tolist() == [0.5 * x for x in range(-16, 16)]
    # byte c holds value c (low nibble) and value c + 16 (high nibble)
    q4 = torch.tensor(list(d) + [(c % 16) | (((15 - c) % 16) << 4) for c in range(16)], dtype=torch.uint8)
    expect = [0.5 * (c - 8) for c in range(16)] + [0.5 * (15 - c - 8) for c in range(16)]
    assert FORMATS["q4_0"].decode(q4, torch.float64).tolist() == expect
    assert ggml_decode(q4, "q4_0").tolist() == expect


@pytest.mark.parametrize("name", BLOCKS)
def test_quantise_writes_blocks_that_ggml_s_layout_reads_back(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 96, generator=g) * torch.tensor([0.1, 4.0]).view(1, 2, 1)
    x[0, 0, :32] = 0  # an all-zero block: d = 0, values 0
    stored, scale, offset = quantise(x, name)
    fmt = FORMATS[name]
    assert stored.dtype is torch.uint8 and stored.shape == (3, 2, 96 // 32 * fmt.block_bytes)
    assert scale is None and offset is None
    back = ggml_decode(stored, name)
    assert torch.equal(back, fmt.decode(stored, torch.float64))  # the library's decoder agrees bit for bit
    assert torch.equal(back[0, 0, :32], torch.zeros(32, dtype=torch.float64))
    peak = x.double().unflatten(-1, (3, 32)).abs().amax(-1, keepdim=True)
    step = peak / (127 if name == "q8_0" else 8)
    err = (back - x.double()).unflatten(-1, (3, 32)).abs()
    # rounded to the nearest step; q4_0's values of the other sign than the largest reach +8 steps, clamped to 7
    bound = step * (0.5 if name == "q8_0" else 1.0) * (1 + 2**-9) + peak * 2**-10
    assert bool((err <= bound).all())


# ------------------------------------------------------------------------------ attention on blocks


def _cache(name, shape, g):
    x = torch.randn(*shape, generator=g)
    stored = quantise(x, name)[0]
    return stored, ggml_decode(stored, name)


ENGINES = ["native", "cpu", "eager", "reference"]


def _run(engine, q, k, v, name, **kw):
    if engine == "reference":
        return tileattn.reference(q, k, v, k_format=name, v_format=name, **kw)
    return tileattn.flash_attention(q, k, v, k_format=name, v_format=name, backend=engine, **kw)


CASES = [  # (label, batch, query heads, kv heads, Sq, Sk, D, Dv, layout, causal)
    ("decode", 2, 4, 4, 1, 37, 64, 64, "BNSD", False),
    ("decode-gqa", 2, 8, 2, 1, 129, 32, 96, "BSND", False),
    ("prefill-causal", 1, 4, 2, 7, 45, 64, 32, "BNSD", True),
    ("long-prefill", 1, 2, 1, 40, 53, 32, 32, "BSND", True),
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_on_blocks_matches_the_reference_on_their_values(case, name, engine):
    _, b, hq, hkv, sq, sk, d, dv, layout, causal = case
    g = torch.Generator().manual_seed(hash((case[0], name)) % 2**31)
    bsnd = layout == "BSND"
    q = torch.randn(*((b, sq, hq, d) if bsnd else (b, hq, sq, d)), generator=g)
    k, kd = _cache(name, (b, sk, hkv, d) if bsnd else (b, hkv, sk, d), g)
    v, vd = _cache(name, (b, sk, hkv, dv) if bsnd else (b, hkv, sk, dv), g)
    want = tileattn.reference(q.double(), kd, vd, layout=layout, causal=causal)
    for _ in range(2):  # the second call of a shape goes through its plan
        out = _run(engine, q, k, v, name, layout=layout, causal=causal)
        assert out.dtype is torch.float32 and out.shape == want.shape
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BLOCKS)
def test_bf16_queries_and_q_scale_on_blocks(name):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 1, 64, generator=g).bfloat16()
    k, kd = _cache(name, (2, 2, 19, 64), g)
    v, vd = _cache(name, (2, 2, 19, 64), g)
    q_scale = torch.tensor([[0.5, 2.0]])
    want = tileattn.reference(q.double() * torch.tensor([0.5, 0.5, 2.0, 2.0]).double().view(1, 4, 1, 1), kd, vd)
    for engine in ENGINES:
        out = _run(engine, q, k, v, name, q_scale=q_scale)
        assert out.dtype is torch.bfloat16
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", BLOCKS)
def test_a_paged_pool_of_blocks(name):
    g = torch.Generator().manual_seed(3)
    pages, page, hkv, d = 6, 8, 2, 64
    k, kd = _cache(name, (pages, page, hkv, d), g)
    v, vd = _cache(name, (pages, page, hkv, d), g)
    table = torch.tensor([[4, 1, 5], [0, 2, 3]], dtype=torch.int32)
    seqused = torch.tensor([21, 11], dtype=torch.int32)
    q = torch.randn(2, 4, 1, d, generator=g)
    want = tileattn.reference(q.double(), kd, vd, block_table=table, seqused_k=seqused)
    for engine in ENGINES:
        out = _run(engine, q, k, v, name, block_table=table, seqused_k=seqused)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BLOCKS)
def test_packed_varlen_blocks(name):
    g = torch.Generator().manual_seed(11)
    cu_q, cu_k = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([0, 13, 33], dtype=torch.int32)
    q = torch.randn(4, 4, 32, generator=g)
    k, kd = _cache(name, (33, 2, 32), g)
    v, vd = _cache(name, (33, 2, 64), g)
    kw = dict(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=20, causal=True)
    want = tileattn.reference(q.double(), kd, vd, **kw)
    for engine in ENGINES:
        torch.testing.assert_close(_run(engine, q, k, v, name, **kw).double(), want, atol=2e-5, rtol=1e-5)


def test_a_named_default_format_is_the_dtype_s_own_bitwise():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 1, 32, generator=g)
    k = torch.randint(-127, 128, (1, 2, 9, 32), generator=g, dtype=torch.int8)
    v = torch.randint(-127, 128, (1, 2, 9, 32), generator=g, dtype=torch.int8)
    scale = torch.full((1, 1, 1, 1), 0.01)
    plain = tileattn.flash_attention(q, k, v, k_scale=scale, v_scale=scale, backend="native")
    named = tileattn.flash_attention(q, k, v, k_scale=scale, v_scale=scale, k_format="int8", v_format="int8",
                                     backend="native")
    assert torch.equal(plain, named)


# -------------------------------------------------------------------------------------- bad input


def _blocks(shape=(1, 2, 5, 64), name="q8_0"):
    return quantise(torch.randn(*shape), name)[0]


def _call(q, k, v, **kw):
    return tileattn.flash_attention(q, k, v, **kw)


@pytest.mark.parametrize("kw,exc,arg", [
    (dict(k_format="q5_0", v_format="q5_0"), ValueError, "k_format"),
    (dict(k_format=8, v_format="q8_0"), TypeError, "k_format"),
    (dict(k_format="q8_0", v_format="q4_0", v=_blocks(name="q4_0")), ValueError, "v_format"),
    (dict(k_format="q8_0"), ValueError, "v_format"),
    (dict(k_format="q8_0", v_format="q8_0", k_scale=torch.ones(1, 1, 1, 1)), ValueError, "k_scale"),
], ids=["unknown", "not-a-name", "two-formats", "v-format-missing", "beside-scale"])
def test_bad_formats_are_refused_naming_the_argument(kw, exc, arg):
    kw = dict(kw)
    q, k, v = torch.randn(1, 2, 1, 64), _blocks(), kw.pop("v", _blocks())
    with pytest.raises(exc, match=f"argument '{arg}'"):
        _call(q, k, v, **kw)


def test_bad_block_tensors_are_refused_naming_the_argument():
    q = torch.randn(1, 2, 1, 64)
    good = _blocks()
    with pytest.raises(ValueError, match="argument 'k'.*multiple of 34"):  # a torn block
        _call(q, good[..., :67], good, k_format="q8_0", v_format="q8_0")
    with pytest.raises(ValueError, match="argument 'k'.*68 bytes of q8_0"):  # whole blocks, the wrong count
        _call(q, _blocks((1, 2, 5, 96)), good, k_format="q8_0", v_format="q8_0")
    with pytest.raises(TypeError, match="argument 'k'.*torch.uint8"):
        _call(q, good.view(torch.int8), good.view(torch.int8), k_format="q8_0", v_format="q8_0")
    with pytest.raises(TypeError, match="argument 'k'"):
        _call(q, torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), k_format="q8_0", v_format="q8_0")
    q40 = torch.randn(1, 2, 1, 40)
    with pytest.raises(ValueError, match="argument 'k_format'.*multiple of 32"):  # D not a multiple of 32
        _call(q40, good[..., :34], good, k_format="q8_0", v_format="q8_0")


def test_quantise_refuses_what_a_block_format_cannot_hold():
    with pytest.raises(ValueError, match="argument 'x'.*multiple of 32"):
        quantise(torch.randn(2, 40), "q4_0")
    with pytest.raises(ValueError, match="argument 'group_size'"):
        quantise(torch.randn(2, 64), "q8_0", group_size=32)
    with pytest.raises(ValueError, match="argument 'symmetric'"):
        quantise(torch.randn(2, 64), "q8_0", symmetric=False)
    with pytest.raises(TypeError, match="argument 'dtype'"):
        quantise(torch.randn(2, 64), "q5_0")


def test_engines_that_cannot_read_blocks_say_why():
    q, k, v = torch.randn(1, 2, 1, 64, requires_grad=True), _blocks(name="q4_0"), _blocks(name="q4_0")
    with pytest.raises(ValueError, match="forward only"):  # quantised caches are inference only
        _call(q, k, v, k_format="q4_0", v_format="q4_0")
    reasons = tileattn.explain(q.detach(), k, v, k_format="q4_0", v_format="q4_0")
    assert reasons["native"] == [] and reasons["cpu"] == [] and reasons["reference"] == []
    for backend in list_backends():  # capabilities are data: an engine without KVQuant refuses the call
        if KVQuant not in backend.capabilities.modifiers:
            assert reasons[backend.name], backend.name
