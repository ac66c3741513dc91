"""The ``tileattn`` command, run as a subprocess on tiny sizes (budget: well under 90 s on 2 cores)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest

from tileattn.tools.cli import main
from tileattn.tools.cli.bench import FIELDS as BENCH_FIELDS
from tileattn.tools.cli.memory import FIELDS as MEMORY_FIELDS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args, cache_dir=None, env=None, timeout=240):
    full_env = dict(os.environ)
    full_env.pop("TILEATTN_BACKEND", None)
    if cache_dir is not None:
        full_env["TILEATTN_CACHE_DIR"] = str(cache_dir)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "tileattn", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def python(code, cache_dir=None, timeout=240):
    full_env = dict(os.environ)
    if cache_dir is not None:
        full_env["TILEATTN_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def native_cache_into(cache_dir):
    """Let a ``cache_dir`` of a test's own (for the tune cache) share this session's built native
    library instead of compiling it again: ``<cache_dir>/native`` points at the session's folder."""
    from tileattn.backends.native import build, kernels

    kernels.load()
    (cache_dir / "native").symlink_to(build.cache_dir(), target_is_directory=True)
    return cache_dir


def table_header(stdout: str, first_column: str) -> list:
    """Column names of the first table whose header starts with ``first_column``."""
    for line in stdout.splitlines():
        if line.split()[:1] == [first_column]:
            return line
    raise AssertionError(f"no table starting with {first_column!r} in:\n{stdout}")


def test_env_reports_versions_machine_and_backends(capsys):
    r = cli("env")
    assert r.returncode == 0, r.stderr
    for word in ("versions", "torch", "numpy", "machine", "cpu", "simd", "backends", "usable on"):
        assert word in r.stdout
    assert main(["env", "--json"]) == 0  # in-process: the JSON form of the same report
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] is True
    assert info["machine"]["cores"] >= 1
    by_name = {b["name"]: b for b in info["backends"]}
    assert "cpu" in by_name["cpu"]["usable_on"]
    if "triton" in by_name and not by_name["triton"]["usable_on"]:
        assert by_name["triton"]["reasons"], "an unusable backend must say why"
    native = info["native"]
    assert native["available"] and "cpu" in by_name["native"]["usable_on"]
    assert native["isa"] in ("avx512", "avx2", "generic") and native["compiler_version"]
    assert os.path.isfile(native["path"]) and native["path"].startswith(native["cache_dir"])
    assert isinstance(native["amx"], bool) and isinstance(native["bf16dot_default"], bool)
    for line in ("native kernels", "status       available", f"isa          {native['isa']}", "AMX          ",
                 "bf16 dot     ", f"library      {native['path']}", native["compiler_version"]):
        assert line in r.stdout, line


def test_env_reports_the_first_build_then_the_cache(tmp_path):
    first = cli("env", "--json", cache_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    built = json.loads(first.stdout)["native"]
    assert built["available"] and not built["cached"] and built["build_seconds"] > 0
    assert built["path"].startswith(str(tmp_path / "native"))
    again = cli("env", cache_dir=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"loaded from the cache (built in {built['build_seconds']:.1f} s on first use)" in again.stdout
    assert f"library      {built['path']}" in again.stdout


def test_env_without_a_compiler_says_why_native_is_unavailable(tmp_path):
    """No compiler and nothing cached: env still exits 0, the cpu engine works, native says why."""
    no_cc = dict(CC="/nonexistent")
    r = cli("env", "--json", cache_dir=tmp_path, env=no_cc)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["ok"] is True
    why = "$CC='/nonexistent' is not an executable compiler"
    assert info["native"]["available"] is False and why in info["native"]["reason"]
    assert info["native"]["cache_dir"] == str(tmp_path / "native")
    by_name = {b["name"]: b for b in info["backends"]}
    assert by_name["native"]["usable_on"] == []
    assert by_name["native"]["reasons"]["cpu"] == [f"native kernels unavailable: {why}"]  # said once
    assert "cpu" in by_name["cpu"]["usable_on"]
    text = cli("env", cache_dir=tmp_path, env=no_cc)
    assert text.returncode == 0, text.stderr
    assert f"status       unavailable: {why}" in text.stdout
    assert "the PyTorch-ops engine ('cpu') serves every CPU call" in text.stdout
    assert not list((tmp_path / "native").glob("*/*.so")), "nothing may be built without a compiler"


def test_verify_passes_for_every_usable_backend():
    r = cli("verify", "--shape", "1,2,64,32", "--causal")
    assert r.returncode == 0, r.stdout + r.stderr
    header = table_header(r.stdout, "oracle")
    for col in ("tensor", "max err", "tolerance", "plain-math err", "verdict"):
        assert col in header
    assert "[cpu] PASS" in r.stdout
    for tensor in ("out", "lse", "dq", "dk", "dv"):
        assert f"reference fp64  {tensor}" in r.stdout
    assert "sdpa fp64       out" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS")


def test_verify_fails_with_exit_1_on_a_wrong_backend():
    # A CPU engine whose output is 1% off: verify must catch it against both oracles.
    r = python("""
        import sys
        from tileattn.core.dispatch import register
        from tileattn.backends.cpu import CpuBackend
        class Off(CpuBackend):
            name = "off_by_one_percent"
            auto = False
            def forward(self, spec, out, lse):
                super().forward(spec, out, lse)
                out.mul_(1.01)
        register(Off())
        from tileattn.tools.cli import main
        sys.exit(main(["verify", "--backend", "off_by_one_percent", "--shape", "1,2,32,16"]))
    """)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[off_by_one_percent] FAIL" in r.stdout
    assert "reference fp64  out" in r.stdout and "FAIL" in r.stdout.splitlines()[-1]


def test_bench_quick_writes_table_csv_json_and_plot(tmp_path):
    paths = {k: tmp_path / f"bench.{k}" for k in ("csv", "json", "png")}
    r = cli("bench", "--preset", "quick", "--csv", paths["csv"], "--json", paths["json"], "--plot", paths["png"])
    assert r.returncode == 0, r.stdout + r.stderr
    header = table_header(r.stdout, "S")
    for col in ("causal", "mode", "provider", "median ms", "spread", "GFLOP/s", "peak mem", "vs sdpa"):
        assert col in header
    assert "[#" in r.stderr, "progress bar expected on stderr"

    with open(paths["csv"]) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == BENCH_FIELDS
    # quick: 2 lengths x 2 modes x 4 providers; tileattn is what dispatch runs: the native engine.
    assert len(rows) == 16
    assert {(r_["provider"], r_["engine"]) for r_ in rows} == {("tileattn", "native"), ("cpu", "cpu"),
                                                              ("sdpa", "sdpa"), ("naive", "naive")}
    assert "engine" in header and " tileattn  native " in r.stdout
    for row in rows:
        assert row["status"] == "ok", row
        assert float(row["median_ms"]) > 0 and float(row["gflops_per_s"]) > 0
        assert float(row["min_ms"]) <= float(row["median_ms"]) <= float(row["max_ms"])
        assert int(row["reps"]) == 2
    sdpa_rows = [r_ for r_ in rows if r_["provider"] == "sdpa"]
    assert all(abs(float(r_["speedup"]) - 1.0) < 1e-9 for r_ in sdpa_rows)
    fwd = {r_["seqlen_q"]: float(r_["flops"]) for r_ in rows if r_["mode"] == "fwd" and r_["provider"] == "cpu"}
    assert fwd["64"] == 4 * 1 * 2 * 64 * 64 * 32  # 4 B H S^2 D, non-causal

    doc = json.loads(paths["json"].read_text())
    assert {"settings", "versions", "machine", "results"} <= set(doc)
    assert len(doc["results"]) == 16
    assert set(BENCH_FIELDS) <= set(doc["results"][0]) and len(doc["results"][0]["times_ms"]) == 2
    png = paths["png"].read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 2000


def test_bench_marks_unsupported_cells_instead_of_crashing(capsys):
    # FlexAttention has no backward on CPU; the triton engine needs a GPU or the interpreter here.
    r = cli("bench", "--seqlens", "64", "--heads", "1", "--head-dim", "16", "--mode", "fwd+bwd",
            "--providers", "cpu,flex", "--baseline", "cpu", "--reps", "1", "--warmup", "0", "--quiet", "--no-memory")
    assert r.returncode == 0, r.stdout + r.stderr
    flex_line = next(line for line in r.stdout.splitlines() if " flex " in line)
    assert "unsupported: FlexAttention on CPU has no backward" in flex_line
    # Nothing runnable at all is a bad request: exit 2 (in-process: nothing is computed).
    assert main(["bench", "--seqlens", "64", "--mode", "bwd", "--providers", "flex", "--quiet"]) == 2
    assert "no provider can run" in capsys.readouterr().err


def test_bench_memory_of_a_first_row_is_that_of_a_call_in_steady_state():
    """The first fwd+bwd row after fwd rows once counted the process's first backward (about 75 MiB
    the native engine keeps for later calls, against 1.6 MiB measured again): in a fresh process,
    each provider's first fwd+bwd figure agrees with the same cell measured again."""
    r = python("""
        import json
        from tileattn.tools.bench import Case, run_case
        rows = [{res.provider: res.peak_mem_bytes for res in run_case(Case(1, 8, 128, 128, 64, mode=mode),
                                                                      ["tileattn", "sdpa"], reps=1, warmup=0)}
                for mode in ("fwd", "fwd+bwd", "fwd+bwd")]
        print(json.dumps(rows))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    _, first, again = json.loads(r.stdout.splitlines()[-1])
    if None in first.values():
        pytest.skip("no peak-memory counter on this system")
    for provider in ("tileattn", "sdpa"):
        tolerance = max(1 << 20, again[provider] // 4)
        assert abs(first[provider] - again[provider]) <= tolerance, (provider, first[provider], again[provider])


def test_memory_shows_naive_quadratic_growth_and_tileattn_savings(tmp_path):
    out_csv, out_png = tmp_path / "mem.csv", tmp_path / "mem.png"
    # Score matrices of 4, 16, 64 and 256 MiB; the cap (0.15 GiB) admits naive up to S=2048. tileattn
    # (the native engine here) keeps per-thread tile buffers of fixed size, so the savings are judged
    # at S=2048, where naive's quadratic term dominates.
    r = cli("memory", "--seqlens", "512,1024,2048,4096", "--heads", "4", "--head-dim", "32", "--modes", "fwd",
            "--cap-gib", "0.15", "--csv", out_csv, "--plot", out_png, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    header = table_header(r.stdout, "S")
    for col in ("score matrix", "naive peak", "tileattn (native) peak", "saving"):
        assert col in header
    assert "skipped (> cap)" in r.stdout
    with open(out_csv) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == MEMORY_FIELDS
    peak = {(row["provider"], int(row["seqlen"])): row for row in rows}
    naive_1024 = int(peak[("naive", 1024)]["peak_bytes"])
    naive_2048 = int(peak[("naive", 2048)]["peak_bytes"])
    score_2048 = int(peak[("naive", 2048)]["score_matrix_bytes"])
    assert score_2048 == 4 * 2048 * 2048 * 4
    # Naive holds the scores and the probabilities: about 2 score matrices, growing as S^2.
    assert naive_2048 >= score_2048
    assert naive_2048 >= 3 * naive_1024
    assert peak[("naive", 4096)]["status"] == "skipped"
    tile_1024 = int(peak[("tileattn", 1024)]["peak_bytes"])
    tile_2048 = int(peak[("tileattn", 2048)]["peak_bytes"])
    assert tile_2048 < naive_2048 / 4
    assert tile_2048 < 2 * tile_1024 + (4 << 20), "tileattn's extra memory must grow linearly, not as S^2"
    assert float(peak[("tileattn", 2048)]["saving_pct"]) > 75
    assert peak[("tileattn", 4096)]["status"] == "ok"
    assert out_png.read_bytes().startswith(PNG_MAGIC)


def test_tune_rejects_over_budget_stores_winner_and_dispatch_uses_it(tmp_path):
    out_json = tmp_path / "tune.json"
    r = cli("tune", "--backend", "cpu", "--shape", "1,2,256,32", "--budget-kib", "64", "--reps", "1", "--warmup", "0",
            "--json", out_json, "--quiet", cache_dir=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    header = table_header(r.stdout, "block_m")
    for col in ("block_n", "working set", "status", "err/tol", "median ms", "reason"):
        assert col in header
    assert "rejected" in r.stdout and "> budget 64 KiB" in r.stdout
    doc = json.loads(out_json.read_text())
    statuses = {c["status"] for c in doc["candidates"]}
    assert statuses == {"rejected", "timed"}
    winner = doc["winner"]
    timed = [c for c in doc["candidates"] if c["status"] == "timed"]
    assert all(c["working_set_bytes"] <= 64 * 1024 and c["max_error_ratio"] <= 1.0 for c in timed)
    best = min(timed, key=lambda c: c["median_ms"])
    assert winner == {"block_m": best["block_m"], "block_n": best["block_n"]}
    assert (tmp_path / "tune_cache.json").exists()

    # A fresh process with the same cache directory: dispatch's default config is the winner.
    check = python("""
        import json, torch
        from tileattn.core.spec import build_spec
        from tileattn.backends.cpu import default_config
        x = torch.empty(1, 2, 256, 32)
        cfg = default_config(build_spec(x, x, x))
        other = default_config(build_spec(x, x, x, causal=True))
        print(json.dumps([cfg.block_m, cfg.block_n, other.block_m, other.block_n]))
    """, cache_dir=tmp_path)
    assert check.returncode == 0, check.stderr
    bm, bn, obm, obn = json.loads(check.stdout)
    assert (bm, bn) == (winner["block_m"], winner["block_n"])
    assert doc["cache_path"] == str(tmp_path / "tune_cache.json")


def test_tune_native_checks_times_and_stores_a_winner_the_native_engine_uses(tmp_path):
    """`tune --backend native` (the default on CPU): the budget model rejects the large tiles, every
    survivor passes the accuracy rule before it is timed, and the winner reaches the kernels' call."""
    native_cache_into(tmp_path)
    out_json = tmp_path / "tune.json"
    r = cli("tune", "--shape", "1,2,256,32", "--budget-kib", "256", "--reps", "2", "--warmup", "0",
            "--json", out_json, "--quiet", cache_dir=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tileattn tune: backend native" in r.stdout and "timing fwd+bwd" in r.stdout
    assert "> budget 256 KiB" in r.stdout
    doc = json.loads(out_json.read_text())
    assert doc["backend"] == "native" and doc["mode"] == "fwd+bwd"
    by_tiles = {(c["block_m"], c["block_n"]): c for c in doc["candidates"]}
    # lanes clamped to the 256 rows of a kv head, keys to the 256 keys: 4 x 3 candidates
    assert set(by_tiles) == {(m, n) for m in (32, 64, 128, 256) for n in (64, 128, 256)}
    assert by_tiles[(128, 256)]["current"], "the kernels' default is the current configuration"
    for c in doc["candidates"]:
        assert (c["status"] == "rejected") == (c["working_set_bytes"] > 256 * 1024), c
        if c["status"] == "timed":
            assert c["max_error_ratio"] <= 1.0 and len(c["times_ms"]) == 2
    timed = [c for c in doc["candidates"] if c["status"] == "timed"]
    assert len(timed) >= 2
    best = min(timed, key=lambda c: c["median_ms"])
    assert doc["winner"] == {"block_m": best["block_m"], "block_n": best["block_n"]}

    check = python("""
        import json, torch
        from tileattn.backends.native import NativeBackend
        from tileattn.core.spec import build_spec
        x = torch.empty(1, 2, 256, 32)
        tuned = NativeBackend._call_arguments(build_spec(x, x, x))[2]
        other = NativeBackend._call_arguments(build_spec(x, x, x, causal=True))[2]
        print(json.dumps([tuned.block_m, tuned.block_n, other.block_m, other.block_n]))
    """, cache_dir=tmp_path)
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == [doc["winner"]["block_m"], doc["winner"]["block_n"], 0, 0]


@pytest.mark.parametrize("argv", [
    ["bench", "--preset", "nope"],
    ["bench", "--seqlens", "0,128"],
    ["bench", "--seqlens", "128,abc"],
    ["bench", "--providers", "cpu,fast"],
    ["bench", "--mode", "sideways"],
    ["bench", "--baseline", "flex"],
    ["bench", "--plot", "out.jpg"],
    ["verify", "--shape", "1,2,x,4"],
    ["verify", "--shape", "1,2,64"],
    ["verify", "--backend", "nope"],
    ["verify", "--dtype", "fp8"],
    ["tune", "--shape", "1,2,0,16"],
    ["tune", "--shape", "1,2,64,16", "--backend", "reference"],
    ["tune", "--shape", "1,2,64,16", "--backend", "triton", "--dtype", "fp64"],
    ["memory", "--seqlens", "-5"],
    ["memory", "--cap-gib", "0"],
    ["frobnicate"],
])
def test_bad_arguments_give_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("tileattn") and "error" in err and "Traceback" not in err


def test_bad_argument_through_the_real_entry_point():
    r = cli("verify", "--backend", "nope")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "tileattn verify: error: argument --backend: got 'nope'; expected one of "
        + r.stderr.split("expected one of ", 1)[1].strip()]
    assert "cpu" in r.stderr and "Traceback" not in r.stderr


def test_contest_module_plugs_in_through_add_subparser(monkeypatch):
    calls = []

    def add_subparser(subparsers):
        p = subparsers.add_parser("contest")
        p.add_argument("--rounds", type=int, default=1)
        p.set_defaults(func=lambda args: calls.append(args.rounds) or 7)

    monkeypatch.setitem(sys.modules, "tileattn.tools.contest", types.SimpleNamespace(add_subparser=add_subparser))
    assert main(["contest", "--rounds", "3"]) == 7
    assert calls == [3]


def test_tuning_models_and_override_are_consistent():
    import torch

    from tileattn.core import tunecache
    from tileattn.tools import tuning
    from tileattn.backends.cpu import default_config
    from tileattn.core.spec import build_spec

    x = torch.empty(1, 4, 100, 40, dtype=torch.float16)
    inp = build_spec(x, x, x)
    # Native: lanes clamped to the 128 rows of a kv head, keys to 128; key tiles in multiples of 32.
    native = tuning.native_candidates(inp)
    assert {(c["block_m"], c["block_n"]) for c in native} == {(m, n) for m in (32, 64, 128) for n in (64, 128)}
    assert all(not tunecache.problems("native", c) for c in native)
    gqa = build_spec(torch.empty(1, 8, 1, 64), torch.empty(1, 2, 512, 64), torch.empty(1, 2, 512, 64))
    assert {c["block_m"] for c in tuning.native_candidates(gqa)} == {32}  # 4 rows per kv head: one panel
    sizes = [tuning.native_working_set({"block_m": m, "block_n": n}, inp) for m, n in ((32, 64), (32, 128), (64, 128))]
    assert 0 < sizes[0] < sizes[1] < sizes[2]
    # the kernels' default tiles fit a 2 MiB L2 at the benchmark's head dims, in fp32
    for d in (64, 128):
        y = torch.empty(1, 8, 4096, d)
        assert tuning.native_working_set(tuning.NATIVE_DEFAULT, build_spec(y, y, y)) < 2 * 2**20
    # Blocks longer than the sequence are clamped, so no two candidates launch the same tiles.
    cpu = tuning.cpu_candidates(inp)
    assert len(cpu) == len({(c["block_m"], c["block_n"]) for c in cpu})
    assert max(c["block_m"] for c in cpu) == 128 and max(c["block_n"] for c in cpu) == 128
    # Triton: Q block plus num_stages K and V blocks, head dim padded to a power of two (64), fp16.
    cfg = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3}
    assert tuning.triton_shared_memory(cfg, inp) == (64 * 64 + 3 * 32 * (64 + 64)) * 2
    # The CPU working set grows with the tile and is what the budget compares against.
    small = tuning.cpu_working_set({"block_m": 32, "block_n": 64}, inp)
    large = tuning.cpu_working_set({"block_m": 128, "block_n": 128}, inp)
    assert 0 < small < large
    budget, source = tuning.cpu_budget()
    assert budget > 0 and source
    with tuning.overriding("cpu", {"block_m": 48, "block_n": 80}):
        assert (default_config(inp).block_m, default_config(inp).block_n) == (48, 80)
    assert (default_config(inp).block_m, default_config(inp).block_n) != (48, 80)


def test_env_reports_integrations_as_they_are_switched_on():
    """`tileattn env` (and its collect()) says which integrations are available and active."""
    import torch
    import torch.nn.functional as F

    import tileattn
    import tileattn.integrations.torch_sdpa as hook
    from tileattn.tools.cli.env import integrations

    before = integrations()
    assert before["patch_sdpa"] == {"active": False}
    assert before["torch_npu_stand_in"] == {"installed": False}
    assert "gloo" in before["torch_distributed"]["backends"]
    with tileattn.patch_sdpa():
        assert integrations()["patch_sdpa"] == {"active": True}
    assert F.scaled_dot_product_attention is not tileattn.scaled_dot_product_attention
    if hook.hook_available():
        hook.register()
        torch.nn.attention.activate_flash_attention_impl("tileattn")
        try:
            assert integrations()["sdpa_hook"]["active"] is True
        finally:
            torch.nn.attention.restore_flash_attention_impl()
        assert integrations()["sdpa_hook"]["active"] is False
    r = cli("env", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)["integrations"]
    assert set(report) == {"sdpa_hook", "patch_sdpa", "transformers", "torch_npu_stand_in", "torch_distributed"}
