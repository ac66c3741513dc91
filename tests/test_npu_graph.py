"""torch_npu's graph-mode entry points of FusedInferAttentionScore, called as vllm-ascend's ACL-graph
capture and update paths call them: ``_get_max_workspace``, ``_infer_output``, ``.out(..., workspace=,
out=[attention_out, softmax_lse])``. The ops themselves are judged against tileattn.reference in
tests/test_npu_infer.py; here ``.out`` must write exactly the op's result into the caller's tensors,
check everything before writing, and the helpers must describe the op's results."""

import pytest
import torch

import tileattn.npu as torch_npu

TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
B, N, NKV, D = 2, 4, 2, 8


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 101 + sum(shape)))


def _vllm_ascend_decode_kwargs():
    """vllm-ascend's graph-captured attention: TND query, (blocks, block_size, H) paged caches, cumulative
    query ends, cached lengths per sequence, sparse_mode=3 with the 2048x2048 template."""
    pool_k, pool_v = _rand(8, 4, NKV * D, seed=1), _rand(8, 4, NKV * D, seed=2)
    table = torch.tensor([[3, 0, 6], [5, 1, -1]], dtype=torch.int32)  # -1: an unused slot
    return dict(query=_rand(3, N, D, seed=3), key=pool_k, value=pool_v, block_table=table, input_layout="TND",
                block_size=4, actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[11, 6], num_key_value_heads=NKV,
                num_heads=N, scale=0.3, sparse_mode=3, atten_mask=TRIU)


def test_out_overload_writes_the_ops_result_into_the_callers_tensors_like_vllm_ascend():
    kwargs = _vllm_ascend_decode_kwargs()
    want, _ = torch_npu.npu_fused_infer_attention_score(**kwargs)
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
    assert isinstance(workspace, torch.Tensor) and workspace.dtype == kwargs["query"].dtype
    output = torch.full_like(want, float("nan"))
    softmax_lse = torch.full((1,), 7.0, dtype=kwargs["query"].dtype)  # a placeholder: no LSE asked for
    result = torch_npu.npu_fused_infer_attention_score.out(**kwargs, workspace=workspace, out=[output, softmax_lse])
    assert result[0] is output and result[1] is softmax_lse
    assert torch.equal(output, want) and softmax_lse.item() == 7.0
    # graph "update": the same call with new lengths writes the new result into the same buffer
    kwargs.update(actual_seq_lengths_kv=[9, 5])
    torch_npu.npu_fused_infer_attention_score.out(**kwargs, workspace=workspace, out=[output, softmax_lse])
    assert torch.equal(output, torch_npu.npu_fused_infer_attention_score(**kwargs)[0])


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSND_NBSD", "TND", "TND_NTD", "NTD_TND"])
def test_v2_out_overload_by_name_with_the_lse_and_infer_output_shapes(layout):
    src = layout.split("_")[0]
    q, k, v = _rand(B, 3, N, D, seed=4), _rand(B, 5, NKV, D, seed=5), _rand(B, 5, NKV, 6, seed=6)  # Dv = 6
    conv = {"BSH": lambda t: t.flatten(2), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2),
            "TND": lambda t: t.flatten(0, 1), "NTD": lambda t: t.flatten(0, 1).transpose(0, 1)}[src]
    lens = dict(actual_seq_qlen=[3, 6], actual_seq_kvlen=[5, 10]) if src in ("TND", "NTD") else {}
    kwargs = dict(query=conv(q), key=conv(k), value=conv(v), num_query_heads=N, num_key_value_heads=NKV,
                  input_layout=layout, softmax_scale=0.3, return_softmax_lse=True,
                  learnable_sink=torch.tensor([0.5, -0.5, 1.0, 0.0]), **lens)
    want, want_lse = torch_npu.npu_fused_infer_attention_score_v2(**kwargs)
    out, lse = torch_npu._npu_fused_infer_attention_score_v2_infer_output(
        kwargs["query"], kwargs["value"], input_layout=layout, num_query_heads=N, num_key_value_heads=NKV,
        return_softmax_lse=True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (want.shape, want.dtype, want_lse.shape, torch.float32)
    workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(**kwargs)
    torch_npu.npu_fused_infer_attention_score_v2.out(**kwargs, workspace=workspace, attention_out=out,
                                                     softmax_lse=lse)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    _, no_lse = torch_npu._npu_fused_infer_attention_score_v2_infer_output(
        kwargs["query"], kwargs["value"], input_layout=layout, num_query_heads=N, num_key_value_heads=NKV)
    assert no_lse.shape == (0,) and no_lse.dtype == torch.float32


def test_the_v1_helpers_describe_a_paged_bsh_decode():
    """(B, 1, H) query over a (blocks, block_size, H) cache: the output's hidden size comes from the
    cache's head dim and num_key_value_heads."""
    pool_k, pool_v = _rand(6, 4, NKV * D, seed=7), _rand(6, 4, NKV * 6, seed=8)
    q = _rand(B, 1, N * D, seed=9)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kwargs = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BSH", scale=0.3, block_table=table,
                  block_size=4, actual_seq_lengths_kv=[7, 3], softmax_lse_flag=True)
    want, want_lse = torch_npu.npu_fused_infer_attention_score(q, pool_k, pool_v, **kwargs)
    out, lse = torch_npu._npu_fused_infer_attention_score_infer_output(
        q, pool_v, input_layout="BSH", block_table=table, num_heads=N, num_key_value_heads=NKV, softmax_lse_flag=True)
    assert out.shape == want.shape == (B, 1, N * 6) and lse.shape == want_lse.shape
    torch_npu.npu_fused_infer_attention_score.out(q, pool_k, pool_v, **kwargs, out=(out, lse))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_out_overload_checks_everything_before_writing():
    kwargs = _vllm_ascend_decode_kwargs()
    fia_out = torch_npu.npu_fused_infer_attention_score.out
    good = torch.zeros(3, N, D)
    lse = torch.zeros(1)
    cases = [
        (ValueError, "'attention_out'.*shape \\(3, 4, 8\\)", dict(out=[torch.zeros(3, N, D + 1), lse])),
        (ValueError, "'attention_out'.*dtype torch.float32", dict(out=[good.double(), lse])),
        (ValueError, "'attention_out'.*device", dict(out=[good.to("meta"), lse])),
        (ValueError, "'softmax_lse'.*shape \\(3, 4, 1\\)", dict(out=[good, lse], softmax_lse_flag=True)),
        (TypeError, "'out'", dict(out=good)),
        (TypeError, "'out'", {}),
        (TypeError, "'workspace'", dict(out=[good, lse], workspace=3)),
        (TypeError, "'no_such_argument'", dict(out=[good, lse], no_such_argument=1)),
        (ValueError, "'block_table'", dict(out=[good, lse], block_table=torch.tensor([[3, 0, 9], [5, 1, -1]],
                                                                                     dtype=torch.int32))),
        (ValueError, "'num_key_value_heads'", dict(out=[good, lse], num_key_value_heads=3)),
    ]
    for exc, match, extra in cases:
        given = extra.get("out") if isinstance(extra.get("out"), list) else []
        outs = [t for t in given if t.device.type != "meta"]
        before = [t.clone() for t in outs]
        with pytest.raises(exc, match=match) as info:
            fia_out(**dict(kwargs, **extra))
        assert isinstance(info.value, RuntimeError), match
        assert all(torch.equal(now, then) for now, then in zip(outs, before)), match


def test_get_max_workspace_checks_like_the_op_and_computes_nothing(monkeypatch):
    kwargs = _vllm_ascend_decode_kwargs()
    monkeypatch.setattr(torch_npu.inference, "flash_attention", lambda *a, **k: pytest.fail("computed"))
    torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs)
    with pytest.raises(ValueError, match="'actual_seq_lengths_kv'") as info:
        torch_npu._npu_fused_infer_attention_score_get_max_workspace(**dict(kwargs, actual_seq_lengths_kv=[13, 6]))
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(NotImplementedError, match="'quant_scale2'"):
        torch_npu._npu_fused_infer_attention_score_get_max_workspace(**kwargs, quant_scale2=torch.ones(1))
    v2 = dict(query=kwargs["query"], key=kwargs["key"], value=kwargs["value"], num_query_heads=N,
              num_key_value_heads=NKV, input_layout="TND", actual_seq_qlen=[1, 3], actual_seq_kvlen=[11, 6],
              block_table=kwargs["block_table"], block_size=4, sparse_mode=3, atten_mask=TRIU)
    torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(**v2)
    with pytest.raises(NotImplementedError, match="out_dtype"):
        torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(**v2, out_dtype=1)


def test_installed_torch_npu_has_the_graph_entry_points():
    torch_npu.install()
    try:
        import torch_npu as installed

        for name in ("_npu_fused_infer_attention_score_get_max_workspace",
                     "_npu_fused_infer_attention_score_v2_get_max_workspace",
                     "_npu_fused_infer_attention_score_infer_output",
                     "_npu_fused_infer_attention_score_v2_infer_output"):
            assert callable(getattr(installed, name))
        assert callable(installed.npu_fused_infer_attention_score.out)
        assert callable(installed.npu_fused_infer_attention_score_v2.out)
    finally:
        torch_npu.uninstall()
