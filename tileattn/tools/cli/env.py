"""``tileattn env``: versions, the machine, the native kernels' build, and which backends work here
(and why not)."""

from __future__ import annotations

import json
import os
import platform
import sys
import warnings
from pathlib import Path

from ..measure import cache_size, cpu_flags, cpu_model, gpus, usable_cores
from .common import fmt_bytes, format_table

HELP = "show versions, the machine and which backends work here"


def add_parser(subparsers):
    p = subparsers.add_parser("env", help=HELP, description=HELP + ". Exit 0 when at least one engine other than the reference works.")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.set_defaults(func=run)
    return p


def _version(module: str):
    try:
        mod = __import__(module)
    except Exception:  # a broken optional package is reported as absent, not a crash
        return None
    return getattr(mod, "__version__", "?")


def probe_backend(backend, device: str) -> list:
    """Reasons ``backend`` cannot run a tiny fp32 call on ``device`` (empty = it ran and was finite)."""
    import torch

    from ... import flash_attention
    from ..bench import describe_error
    from ...core.spec import build_spec

    unavailable = backend.unavailable_reason()
    if unavailable:
        return [unavailable]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen).to(device) for _ in range(3))
    why = backend.not_supported_reasons(build_spec(q, k, v))
    if why:
        return why
    try:
        out = flash_attention(q, k, v, backend=backend.name)
    except Exception as exc:  # the probe exists to catch exactly this
        return [f"probe call failed: {describe_error(exc)}"]
    if not bool(torch.isfinite(out).all()):
        return ["probe call returned non-finite values"]
    return []


def native_report() -> dict:
    """The native kernels here: which library was loaded (prebuilt in the wheel or compiled here), from
    where and why; how it was built (compiler, ISA, AMX and bf16 dot-product choice, build time, from
    the cache or not), or why there is none."""
    from ...backends.native import build, kernels, prebuilt

    forced = os.environ.get(build.ISA_ENV) or None
    mode = os.environ.get(prebuilt.MODE_ENV) or None
    ok, why = kernels.available()
    if not ok:
        return {"available": False, "reason": why, "cache_dir": str(build.cache_dir()), "isa_forced": forced,
                "mode": mode}
    info = kernels.build_info()
    try:  # written by the process that compiled the library: its build time, when this one loaded it
        first_build = json.loads((Path(info["path"]).parent / "build.json").read_text())["build_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        first_build = None
    return dict(info, available=True, cache_dir=str(build.cache_dir()), isa_forced=forced, mode=mode,
                first_build_seconds=first_build)


def integrations() -> dict:
    """Which integrations this process offers and has switched on, with versions."""
    import torch
    import torch.nn.functional as F

    from ...dialects import sdpa
    from ...dialects import sdpa_hook as torch_sdpa, transformers as hf
    from ...dialects import npu

    hook = torch_sdpa.status()
    hf_report = hf.integration_report()
    dist = torch.distributed
    backends = ([name for name, probe in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                                           ("mpi", dist.is_mpi_available)) if probe()]
                if dist.is_available() else [])
    return {
        "sdpa_hook": dict(hook, torch=torch.__version__),
        "patch_sdpa": {"active": F.scaled_dot_product_attention is sdpa.scaled_dot_product_attention},
        "transformers": {"version": hf_report["transformers"], "registered": hf_report["registered"],
                         "architectures_tested": len(hf_report["architectures"])},
        "torch_npu_stand_in": {"installed": npu.installed()},
        "torch_distributed": {"available": dist.is_available(), "backends": backends},
    }


def collect() -> dict:
    import torch

    from ...core.dispatch import list_backends

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    backends = []
    for b in list_backends():
        with warnings.catch_warnings():  # an engine that cannot start warns; here its reason is the report
            warnings.simplefilter("ignore", RuntimeWarning)
            per_device = {d: probe_backend(b, d) for d in devices}
        backends.append({
            "name": b.name, "priority": b.priority, "auto": b.auto,
            "usable_on": [d for d, why in per_device.items() if not why],
            "reasons": {d: why for d, why in per_device.items() if why},
        })
    from ... import __version__

    return {
        "versions": {
            "tileattn": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "triton": _version("triton"), "numpy": _version("numpy"), "numba": _version("numba"),
            "cuda_runtime": torch.version.cuda,
        },
        "machine": {
            "os": platform.platform(), "cpu": cpu_model(), "cores": usable_cores(),
            "torch_threads": torch.get_num_threads(), "simd": cpu_flags(),
            "l2_per_core_bytes": cache_size(2), "gpus": gpus(),
        },
        "native": native_report(),
        "backends": backends,
        "integrations": integrations(),
    }


def run(args) -> int:
    info = collect()
    ok = any(b["usable_on"] for b in info["backends"] if b["name"] != "reference")
    if args.json:
        print(json.dumps(dict(info, ok=ok), indent=1))
        return 0 if ok else 1
    v, m = info["versions"], info["machine"]
    print("versions")
    for name, ver in v.items():
        print(f"  {name:<12} {ver if ver is not None else 'not installed'}")
    print("machine")
    print(f"  os           {m['os']}")
    print(f"  cpu          {m['cpu']}")
    print(f"  cores        {m['cores']} usable, torch uses {m['torch_threads']} threads")
    print(f"  simd         {' '.join(m['simd']) or 'unknown'}")
    print(f"  L2 per core  {fmt_bytes(m['l2_per_core_bytes'])}")
    if m["gpus"]:
        for g in m["gpus"]:
            print(f"  gpu {g['index']}        {g['name']}, {g['memory_gib']} GiB, compute capability "
                  f"{g['compute_capability']}, {g['multiprocessors']} SMs")
    else:
        print("  gpu          none visible to torch")
    print("native kernels")
    for line in _native_lines(info["native"], m["simd"]):
        print("  " + line)
    print("backends")
    rows = []
    for b in info["backends"]:
        usable = ", ".join(b["usable_on"]) or "no"
        why = "; ".join(f"{d}: {', '.join(r)}" for d, r in b["reasons"].items())
        role = "auto" if b["auto"] else "explicit only"
        rows.append([b["name"], role, usable, why])
    print("\n".join("  " + line for line in format_table(["backend", "chosen by", "usable on", "why not"], rows).splitlines()))
    print("integrations")
    for line in _integration_lines(info["integrations"]):
        print("  " + line)
    if not ok:
        print("tileattn env: no engine other than the reference works here", file=sys.stderr)
    return 0 if ok else 1


def _native_lines(n: dict, simd: list) -> list:
    if not n["available"]:
        return [f"status       unavailable: {n['reason'].removeprefix('native kernels unavailable: ')}",
                "             the PyTorch-ops engine ('cpu') serves every CPU call",
                f"cache        {n['cache_dir']}"]
    if n["amx"]:
        amx = "on: bf16 products on AMX tiles"
    elif "amx_bf16" in simd:
        amx = "off: the CPU has AMX-BF16 but this build or the kernel does not grant it"
    else:
        amx = "off: no AMX-BF16 on this CPU"
    if not n["bf16dot"]:
        dot = "not built (no AVX512_BF16)"
    else:
        dot = (f"vdpbf16ps built, {'on' if n['bf16dot_default'] else 'off'}: {n['bf16dot_speedup']}x the fp32 FMA "
               "rate here (used at >= 1.25x)")
    if n["source"] == "prebuilt":
        built = "the prebuilt library shipped in the wheel (nothing compiled here)"
    elif n["cached"]:
        built = "compiled here, loaded from the cache" + (f" (built in {n['first_build_seconds']:.1f} s on first use)"
                                                          if n["first_build_seconds"] is not None else "")
    else:
        built = f"compiled here by this process in {n['build_seconds']:.1f} s"
    isa = n["isa"] + (f" (forced by {n['isa_forced']!r} in TILEATTN_NATIVE_ISA)" if n["isa_forced"] else
                      " (the best this CPU runs)" if n["source"] == "prebuilt" else
                      " (the best this CPU and compiler build)")
    mode = f"TILEATTN_NATIVE={n['mode']}" if n["mode"] else "TILEATTN_NATIVE unset: auto"
    return [
        f"status       available, {built}",
        f"why          {n['reason']} ({mode})",
        f"compiler     {n['compiler_version']} ({n['compiler']} {n['flags']})"
        + (", when the wheel was built" if n["source"] == "prebuilt" else ""),
        f"isa          {isa}",
        f"AMX          {amx}",
        f"bf16 dot     {dot}",
        f"threads      {'OpenMP' if n['openmp'] else 'a pool of POSIX threads (the compiler has no OpenMP runtime)'}",
        f"library      {n['path']}",
    ]


def _integration_lines(i: dict) -> list:
    def on(flag, yes="active", no="not active"):
        return yes if flag else no

    hook, hf = i["sdpa_hook"], i["transformers"]
    hook_line = ("not in this torch (use patch_sdpa)" if not hook["available"] else
                 f"{on(hook['registered'], 'registered', 'not registered')}, {on(hook['active'])}")
    hf_line = ("not installed" if hf["version"] is None else
               f"{hf['version']}, {on(hf['registered'], 'registered', 'not registered')} "
               f"({hf['architectures_tested']} architectures tested)")
    dist = i["torch_distributed"]
    rows = [
        (f"SDPA hook (torch {hook['torch']})", hook_line),
        ("patch_sdpa", on(i["patch_sdpa"]["active"])),
        ("Hugging Face transformers", hf_line),
        ("torch_npu stand-in", on(i["torch_npu_stand_in"]["installed"], "installed", "not installed")),
        ("torch.distributed", (", ".join(dist["backends"]) or "no backend") if dist["available"] else "not available"),
    ]
    width = max(len(label) for label, _ in rows)
    return [f"{label:<{width}}  {value}" for label, value in rows]
