"""Layering: the core (operator, engines, dialects) never imports the tooling (bench, tuning, contest,
the command, measure), and the import graph of tileattn has no large cycle.

Before the tune cache moved to ``tileattn.core.tunecache``, the engines reached the tooling through
``tileattn.tools.tuning`` (the Triton launcher at import, the CPU engine on its first call), and 16 modules
formed one import cycle: dispatch -> backends -> triton/launch -> tuning -> bench -> dispatch.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tileattn"
TOOLING = ("tileattn.tools", "tileattn.__main__")
#: Engines register with tileattn.core.engine, which dispatch imports too, so the registry is no cycle.
#: No import cycle is left (the flash-attn dialect's interface and kvcache share checks.py): the
#: largest strongly connected component of the import graph has 0 modules.
MAX_CYCLE = 0


def _is_tooling(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLING)


def _modules() -> dict:
    """Module name -> (path, is a package) for every module of the tileattn package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def import_graph() -> dict:
    """name -> names of tileattn modules it imports: at module level, inside functions (deferred
    imports are dependencies too) and through ``importlib.import_module("literal")``."""
    modules = _modules()

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names if a.name.startswith("tileattn"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    source = base + ("." + node.module if node.module else "")
                else:
                    source = node.module or ""
                if source.startswith("tileattn"):
                    for a in node.names:
                        full = f"{source}.{a.name}"
                        targets.add(full if full in modules else resolve(source))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).startswith("tileattn")):
                targets.add(resolve(node.args[0].value))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_sees_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_tooling_module_in_an_import_cycle_and_the_largest_cycle_is_small():
    found = cycles(import_graph())
    largest = max(found, key=len, default=[])
    print(f"largest import cycle among tileattn modules: {len(largest)} modules {largest}")
    with_tooling = [c for c in found if any(_is_tooling(m) for m in c)]
    assert not with_tooling, f"the tooling is part of an import cycle: {with_tooling}"
    assert len(largest) <= MAX_CYCLE, f"an import cycle of {len(largest)} modules: {largest}"


def test_core_modules_never_import_the_tooling():
    """One fresh interpreter imports every core module in turn, then runs attention forward and
    backward on the CPU engine (whose tune-cache look-up is a deferred import), explain() and the
    SDPA dialect; after each step no tooling module may be loaded.

    One process, not one per module: every ``tileattn.X`` import runs ``tileattn/__init__`` first,
    so separate processes would import the same modules, 25 times the cost. The step after which a
    tooling module first appears is named in the failure.
    """
    core = sorted(m for m in _modules() if not _is_tooling(m))
    if importlib.util.find_spec("transformers") is None:
        core = [m for m in core if m not in ("tileattn.integrations.transformers", "tileattn.dialects.transformers")]
    script = textwrap.dedent("""
        import importlib, json, sys
        TOOLING = %r

        def tooling():
            return sorted(m for m in sys.modules if any(m == t or m.startswith(t + ".") for t in TOOLING))

        report = []
        for name in %r:
            importlib.import_module(name)
            report.append([name, tooling()])
        import torch, tileattn
        q, k, v = (torch.randn(1, 2, 96, 16, requires_grad=True) for _ in range(3))
        tileattn.flash_attention(q, k, v, causal=True, backend="cpu").sum().backward()
        report.append(["flash_attention(backend='cpu') forward and backward", tooling()])
        tileattn.explain(q, k, v)
        tileattn.scaled_dot_product_attention(q, k, v, is_causal=True)
        report.append(["explain() and the SDPA dialect", tooling()])
        print(json.dumps(report))
    """) % (TOOLING, core)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(core) + 2
    first_bad = next(((step, loaded) for step, loaded in report if loaded), None)
    assert first_bad is None, f"after {first_bad[0]!r} the tooling modules {first_bad[1]} are loaded"


#: What each layer may import, besides itself and the package root's alias helper: the folders are
#: the layers (programs -> core -> engines -> dialects -> distributed -> tools; programs, the user
#: functions' compiler, is the lowest and imports nothing else of tileattn). ``tileattn.serving``
#: (writing quantised caches) sits on the core, and a dialect's cache (transformers' PagedCache)
#: writes through it. ``tileattn.fused`` (the operators around attention: norm_qkv, attention_out_proj)
#: sits on the core too, and the transformers dialect fuses models with it. Never the package root itself: it imports every layer, so that arrow would
#: climb back up (a dialect calls core.api).
ALLOWED = {
    "tileattn.programs": ("tileattn.programs",),
    "tileattn.core": ("tileattn.core", "tileattn.backends", "tileattn.programs"),
    "tileattn.backends": ("tileattn.core", "tileattn.backends", "tileattn.programs"),
    "tileattn.serving": ("tileattn.core", "tileattn.backends", "tileattn.programs"),
    "tileattn.fused": ("tileattn.core", "tileattn.programs", "tileattn.fused"),
    "tileattn.dialects": ("tileattn.core", "tileattn.backends", "tileattn.programs", "tileattn.dialects",
                          "tileattn.serving", "tileattn.fused"),
}


def _layer(name: str, layers) -> str:
    return next((x for x in layers if name == x or name.startswith(x + ".")), "")


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph()
    wrong = []
    for name, targets in graph.items():
        layer = _layer(name, ALLOWED)
        if not layer:
            continue
        for t in targets:
            if t == "tileattn._aliases" or _layer(t, ALLOWED[layer]):
                continue
            wrong.append(f"{name} imports {t}")
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_the_old_public_paths_are_the_moved_modules():
    """Code written against tileattn.npu, tileattn.compat.flash_attn, tileattn.sdpa and
    tileattn.integrations.* keeps working, with the same module objects (state and patches shared)."""
    import tileattn.compat.flash_attn.kvcache as old_kvcache
    import tileattn.dialects.flash_attn.kvcache as new_kvcache
    import tileattn.integrations.torch_sdpa
    import tileattn.npu
    import tileattn.sdpa
    from tileattn.dialects import flash_attn, npu, sdpa, sdpa_hook

    assert old_kvcache is new_kvcache
    assert sys.modules["tileattn.compat.flash_attn"] is flash_attn
    assert tileattn.npu is npu and sys.modules["tileattn.npu.inference"] is sys.modules["tileattn.dialects.npu.inference"]
    assert sys.modules["tileattn.sdpa"] is sdpa and sys.modules["tileattn.integrations.torch_sdpa"] is sdpa_hook
    proc = subprocess.run([sys.executable, "-m", "tileattn.npu", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: python -m tileattn.npu" in proc.stdout, proc.stderr[-2000:]
