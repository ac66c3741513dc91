"""Modifiers in, kernel arguments out: the variant keywords become modifier objects in one place,
each modifier lowers itself into the one kernel-arguments record the engines read, engines support
exactly the modifier types they declare, and a modifier type defined outside the package (here, in
this file and nowhere else) runs on the reference and on every engine that declares it.
"""

from __future__ import annotations

import ast
import inspect
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import tileattn
from tileattn import NoBackendError
from tileattn.core import plans
from tileattn.core.dispatch import Capabilities, get_backend, list_backends
from tileattn.core.engine import Backend
from tileattn.core.functions import MaskMod, ScoreMod
from tileattn.core.kernel_args import KernelArgs
from tileattn.core.kvquant import KVQuant
from tileattn.core.modifiers import (OP_INT, OP_TENSOR, Alibi, Band, Bias, Dropout, Mask, Modifier, Softcap, fail,
                                modifier_types, modifiers_from_keywords, variant_keywords)
from tileattn.core.spec import AttentionSpec, build_spec

from conftest import CPU_BACKENDS, assert_matches_reference, make_qkv

PACKAGE = Path(tileattn.__file__).parent


# ------------------------------------------------------------------------------------- modifiers in


def test_the_variant_keywords_are_declared_by_the_modifier_types_and_mirrored_by_the_public_signature():
    declared = variant_keywords()
    assert set(declared) == {"softcap", "alibi_slopes", "bias", "causal", "window", "mask", "sinks", "dropout_p",
                             "seed", "generator", "k_scale", "k_offset", "v_scale", "v_offset", "q_scale",
                             "k_format", "v_format", "score_mod", "mask_mod", "block_mask"}
    public = inspect.signature(tileattn.flash_attention).parameters
    for name, default in declared.items():
        assert public[name].default == default and type(public[name].default) is type(default), name
    # Every other entry point takes them through the one parser, not a list of its own.
    from tileattn.distributed import context_parallel_attention

    for fn in (build_spec, context_parallel_attention, tileattn.reference, tileattn.attention_partial,
               tileattn.explain):
        assert not set(inspect.signature(fn).parameters) & set(declared), fn.__name__


def test_keywords_become_modifiers_in_pipeline_order_and_objects_join_them():
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    found = modifiers_from_keywords(dict(dropout_p=0.5, seed=3, mask=mask, causal=True, softcap=2.0, q="not read"))
    assert [type(m) for m in found] == [Softcap, Band, Mask, Dropout]
    assert found[1] == Band(None, 0) and found[3] == Dropout(0.5, 3)
    assert modifiers_from_keywords({}) == ()
    q, k, v = make_qkv(b=1, hq=2, sq=4, d=8)
    spec = build_spec(q, k, v, softcap=1.0, modifiers=[Band(2, 0)])
    assert [type(m) for m in spec.modifiers] == [Softcap, Band]
    with pytest.raises(ValueError, match="two band modifiers"):
        build_spec(q, k, v, causal=True, modifiers=[Band(2, 0)])
    with pytest.raises(TypeError, match="argument 'casual': got an unexpected keyword"):
        build_spec(q, k, v, casual=True)
    with pytest.raises(TypeError, match="argument 'modifiers'"):
        tileattn.flash_attention(q, k, v, modifiers=["causal"])
    with pytest.raises(ValueError, match="argument 'window'"):
        tileattn.flash_attention(q, k, v, modifiers=[Band(-2, None)])


# ------------------------------------------------------------------------------ kernel arguments out


def test_each_modifier_lowers_into_the_kernel_arguments_once_and_binds_its_tensors_per_call():
    q, k, v = make_qkv(b=2, hq=2, sq=8, d=8)
    mask, bias, slopes = torch.ones(2, 1, 8, 8, dtype=torch.bool), torch.zeros(8, 8), torch.ones(2)
    spec = build_spec(q, k, v, window=(3, 2), softcap=5.0, mask=mask, bias=bias, alibi_slopes=slopes,
                      dropout_p=0.25, seed=7, sinks=torch.zeros(2), align=-2)
    a = spec.kernel_args
    assert (a.scale, a.bottom_right, a.shift, a.left, a.right, a.softcap, a.dropout_p, a.seed) == \
        (spec.scale, False, -2, 3, 2, 5.0, 0.25, 7)
    assert a.mask is mask and a.bias.shape == (1, 1, 8, 8) and a.alibi_slopes is slopes
    assert a.per_call == {"mask", "bias", "alibi_slopes", "seed"} and a.band == Band(3, 2)
    static = a.static()
    assert all(getattr(static, f) is None for f in ("mask", "bias", "alibi_slopes")) and static.seed == 0
    assert KernelArgs(scale=1.0).band is None and build_spec(q, k, v, causal=True).kernel_args.causal
    # The sinks are merged above the engines: no kernel argument, and engines never see them.
    assert spec.for_engines().modifiers == tuple(m for m in spec.modifiers if m.kind != "sinks")


def test_engines_support_exactly_the_modifier_types_they_declare():
    assert Capabilities(devices=frozenset(("cpu",))).modifiers == frozenset()

    class Bare(Backend):
        name = "bare"
        capabilities = Capabilities(devices=frozenset(("cpu",)))

    q, k, v = make_qkv(b=1, hq=2, sq=4, d=8)
    assert Bare().not_supported_reasons(build_spec(q, k, v)) == []
    assert Bare().not_supported_reasons(build_spec(q, k, v, causal=True, softcap=1.0)) == \
        ["modifiers not supported: softcap, band"]
    assert Bare().not_supported_reasons(build_spec(q, k, v, sinks=torch.zeros(2))) == []  # merged above engines
    for b in list_backends():
        assert all(isinstance(t, type) and issubclass(t, Modifier) for t in b.capabilities.modifiers), b.name


def _samples():
    """One call per modifier type an engine may declare: (type, q, k, v, keywords)."""
    q, k, v = make_qkv(b=1, hq=2, sq=9, sk=13, d=8, seed=5)
    g = torch.Generator().manual_seed(6)
    k8, v8 = (torch.randint(-100, 100, t.shape, generator=g, dtype=torch.int8) for t in (k, v))
    plain = (q, k, v)
    return [
        (Softcap, *plain, dict(softcap=2.0)),
        (Alibi, *plain, dict(alibi_slopes=torch.tensor([0.3, 0.1]))),
        (Bias, *plain, dict(bias=torch.randn(1, 2, 9, 13, generator=g))),
        (Band, *plain, dict(window=(4, 1))),
        (Mask, *plain, dict(mask=torch.rand(9, 13, generator=g) > 0.3)),
        (Dropout, *plain, dict(dropout_p=0.25, seed=3)),
        (KVQuant, q, k8, v8, dict(k_scale=torch.full((1, 1, 1, 1), 0.01), v_scale=torch.full((1, 1, 1, 1), 0.02))),
        (ScoreMod, *plain, dict(score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j).abs())),
        (MaskMod, *plain, dict(mask_mod=lambda b, h, i, j: (i + j) % 3 != 0)),
    ]


def test_each_engine_lists_its_own_modifier_types_and_runs_each_of_them():
    """No engine takes its modifier types from a set another engine uses (a type added for one engine
    is granted to no other), but for an engine that is another's arithmetic (eager: the reference in
    blocks). Every type a CPU engine lists runs there, within the accuracy rule of the reference."""
    from tileattn.core import engine

    assert not hasattr(engine, "BUILTIN_MODIFIERS")
    engines = list_backends()
    for a in engines:
        for b in engines:
            if a is not b and a.capabilities.modifiers is b.capabilities.modifiers:
                assert isinstance(a, type(b)) or isinstance(b, type(a)), (a.name, b.name)
    samples = _samples()
    assert {cls for cls, *_ in samples} >= {t for b in engines for t in b.capabilities.modifiers}
    for name in CPU_BACKENDS:
        declared = get_backend(name).capabilities.modifiers
        for cls, q, k, v, kwargs in samples:
            if cls in declared:
                assert tileattn.explain(q, k, v, **kwargs)[name] == [], (name, cls)
                assert_matches_reference(name, q, k, v, grad=False, **kwargs)


def _declarations(tree):
    """The nodes of an engine module's modifier declarations: the class attribute ``capabilities`` and
    module constants named ``*_MODIFIERS`` (where modifier types are data)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and (t.id == "capabilities" or t.id.endswith("_MODIFIERS")) for t in node.targets):
            found.extend(ast.walk(node.value))
    return {id(n) for n in found}


def test_no_engine_and_not_the_reference_look_a_modifier_up_by_name():
    """Engines read the kernel arguments; the reference calls the modifiers' hooks. Neither asks a
    call for "its band" or "its mask" by name (the spec no longer offers it). An engine names the
    modifier types it runs only in its capabilities (data), never to test a call's modifiers."""
    assert not hasattr(AttentionSpec, "modifier") and not hasattr(AttentionSpec, "without")
    files = [PACKAGE / "core" / "reference.py", *sorted((PACKAGE / "backends").rglob("*.py"))]
    for path in files:
        tree = ast.parse(path.read_text())
        declared = _declarations(tree)
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("modifier", "kinds", "kind"), f"{path.name} reads .{node.attr}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith(("modifiers", "functions", "kvquant")):
                imported |= {a.name for a in node.names if a.name[:1].isupper()} - {"Band"}
        # Band, as the geometry of the band kernel arguments (KernelArgs.band), may be used anywhere
        uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in imported and id(n) not in declared]
        assert not uses, f"{path.name} uses modifier types outside its capabilities: {sorted({n.id for n in uses})}"


def test_no_module_switches_on_a_modifier_s_type():
    """What differs by modifier type is asked of the modifier (its attributes and methods: how context
    parallelism shards it, what ranks agree on, the band of keys it limits rows to, its kernel
    arguments); outside the modifiers' own modules no code tests a modifier's type or kind. The
    engines' capabilities name types as data (the check above); the user-function compiler's
    ``kind`` is a program's ("score" / "mask"), not a modifier's."""
    own = {"core/modifiers.py", "core/functions.py", "core/kvquant.py"}
    types = {cls.__name__ for cls in modifier_types()}
    kinds = {cls.kind for cls in modifier_types()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in own or rel.startswith("programs/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                if {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & types:
                    found.append(f"{rel}:{node.lineno} isinstance")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "kind" for s in sides) and any(
                        isinstance(c, ast.Constant) and c.value in kinds for s in sides for c in ast.walk(s)):
                    found.append(f"{rel}:{node.lineno} .kind")
                if any(isinstance(s, ast.Name) and s.id in types for s in sides):
                    found.append(f"{rel}:{node.lineno} type")
    assert not found, found


# --------------------------------------------------------- a modifier type from outside the package


@dataclass(frozen=True)
class RecentKeys(Modifier):
    """Each query sees its ``width`` most recent keys, itself included: ``0 <= i + off - j < width``.
    The reference applies this rule; the kernels get it lowered into their band arguments."""

    kind: ClassVar[str] = "test_recent_keys"
    stage: ClassVar[int] = 3
    masks: ClassVar[bool] = True
    positional: ClassVar[bool] = True
    width: int = field(metadata=OP_INT)

    def check(self, spec):
        if type(self.width) is not int or self.width < 1:
            fail(ValueError, "width", repr(self.width), "an int >= 1")

    def lower(self):
        return {"left": self.width - 1, "right": 0}

    def visible(self, block):
        back = block.rows[:, None] + block.offset - block.cols[None, :]
        return (back >= 0) & (back < self.width)


@dataclass(frozen=True)
class HeadShift(Modifier):
    """Adds one constant per query head to every score: lowered as a bias that broadcasts over rows
    and keys."""

    kind: ClassVar[str] = "test_head_shift"
    stage: ClassVar[int] = 2
    binds: ClassVar[tuple] = ("bias",)
    shift: torch.Tensor = field(metadata=OP_TENSOR)

    def check(self, spec):
        if not isinstance(self.shift, torch.Tensor) or tuple(self.shift.shape) != (spec.heads_q,):
            fail(ValueError, "shift", getattr(self.shift, "shape", self.shift), f"a tensor of shape ({spec.heads_q},)")

    def lower(self):
        return {}

    def bind(self):
        return {"bias": self.shift.reshape(1, -1, 1, 1)}

    def scores(self, s, block):
        return s + self.shift[block.heads].to(s.dtype)[:, None, None]


@pytest.fixture
def declared(monkeypatch):
    """The engines of the CPU tests declare the two types; the reference and Triton engines do not."""
    plans.clear()  # plans remember engine choices, which a changed declaration changes
    for name in CPU_BACKENDS:
        engine = get_backend(name)
        monkeypatch.setattr(engine, "capabilities", replace(
            engine.capabilities, modifiers=engine.capabilities.modifiers | {RecentKeys, HeadShift}))
    yield CPU_BACKENDS
    plans.clear()


def test_the_reference_applies_a_modifier_type_of_its_own_by_its_hooks():
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=9, sk=13, d=8, dtype=torch.float64)
    torch.testing.assert_close(tileattn.reference(q, k, v, modifiers=[RecentKeys(4)]),
                               tileattn.reference(q, k, v, window=(3, 0)), rtol=0, atol=0)
    shift = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(tileattn.reference(q, k, v, modifiers=[HeadShift(shift)]),
                               tileattn.reference(q, k, v, bias=shift[:, None, None]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_modifier_type_defined_outside_the_package_runs_on_every_engine_that_declares_it(declared, dtype):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=37, sk=53, d=16, dtype=dtype)
    shift = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for backend in declared:
        assert_matches_reference(backend, q, k, v, modifiers=[RecentKeys(7)], return_lse=True)
        assert_matches_reference(backend, q, k, v, modifiers=[HeadShift(shift), RecentKeys(20)], softcap=3.0)
        # A decode step through the plan memo: the third call is served by the plan the second made.
        q1 = q[:, :, :1]
        first, _, again = (tileattn.flash_attention(q1, k, v, modifiers=[RecentKeys(5)], backend=backend)
                           for _ in range(3))
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        exact = tileattn.reference(q1, k, v, modifiers=[RecentKeys(5)], compute_dtype=torch.float64)
        assert (again.double() - exact).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)


def test_engines_that_do_not_declare_it_refuse_it_with_a_reason(declared):
    q, k, v = make_qkv(b=1, hq=2, sq=8, d=8)
    reasons = tileattn.explain(q, k, v, modifiers=[RecentKeys(3)])
    assert reasons["reference"] == ["modifiers not supported: test_recent_keys"]
    assert all(reasons[name] == [] for name in declared)
    with pytest.raises(NoBackendError, match="reference: modifiers not supported: test_recent_keys"):
        tileattn.flash_attention(q, k, v, modifiers=[RecentKeys(3)], backend="reference")
    # Two modifiers lowering into the same kernel argument: refused by name, before any compute.
    with pytest.raises(ValueError, match="band and test_recent_keys, which both set the kernel argument"):
        tileattn.flash_attention(q, k, v, causal=True, modifiers=[RecentKeys(3)], backend=declared[0])


def test_an_undeclared_modifier_type_is_refused_by_every_engine():
    plans.clear()
    q, k, v = make_qkv(b=1, hq=2, sq=8, d=8)
    with pytest.raises(NoBackendError) as info:
        tileattn.flash_attention(q, k, v, modifiers=[RecentKeys(3)])
    for b in list_backends():
        assert f"{b.name}:" in str(info.value)
    assert str(info.value).count("modifiers not supported: test_recent_keys") >= len(CPU_BACKENDS) + 1


# ------------------------------------------------------ acceptance never depends on earlier calls

#: (keyword, a value accepted, a value of another type that == it and must be refused, other keywords)
EQUAL_BUT_REFUSED = [
    ("align", 1, True, {}), ("align", 0, False, {}), ("scale", 1.0, True, {}), ("scale", 1, True, {}),
    ("causal", True, 1, {}), ("causal", False, 0, {}), ("deterministic", False, 0, {}),
    ("deterministic", True, 1, {}), ("softcap", 1.0, True, {}), ("dropout_p", 0.0, False, {}),
    ("window", (1, 1), (True, 1), {}), ("num_heads", 1, True, {"layout": "BSH"}),
]


@pytest.mark.parametrize("good_first", [True, False], ids=["good-first", "bad-first"])
@pytest.mark.parametrize("name,good,bad,extra", EQUAL_BUT_REFUSED,
                         ids=[f"{n}={g!r}/{b!r}" for n, g, b, _ in EQUAL_BUT_REFUSED])
def test_a_value_refused_on_a_fresh_shape_is_refused_after_an_equal_value_was_accepted(name, good, bad, extra,
                                                                                        good_first):
    assert good == bad and hash(good) == hash(bad)  # what made the plan memo confuse them
    layout = extra.get("layout", "BNSD")
    sq = 3 + len(name) + 17 * good_first  # a shape of its own for each case
    heads = good if name == "num_heads" else 2
    q, k, v = make_qkv(b=1, hq=heads, sq=sq, d=8, layout=layout)
    extra = dict(extra, num_heads=heads) if layout == "BSH" and name != "num_heads" else extra

    def call(value):
        return tileattn.flash_attention(q, k, v, **extra, **{name: value})

    if good_first:
        for _ in range(3):  # the third call is served by the plan the second made
            call(good)
    for _ in range(2):
        with pytest.raises(TypeError, match=f"argument '{name}'"):
            call(bad)
    call(good)
    with pytest.raises(TypeError, match=f"argument '{name}'"):
        call(bad)
    assert math.isfinite(float(call(good).abs().sum()))
