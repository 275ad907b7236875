"""Kernel taxonomy: the shipped rules on real kernel names, user rules taking precedence, bad rules."""
from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from servelab.analyse.trace.load import load_trace
from servelab.analyse.trace.taxonomy import CLASSES, classify_names, default_rules, load_rules, short_name


@pytest.mark.parametrize("name, cls, sub", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm", "gemm"),
    ("Cijk_Ailk_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1_SN", "gemm", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", "attention", "attention"),
    ("flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention", "attention"),
    ("BatchPrefillWithPagedKVCacheKernel<...>", "attention", "attention"),
    ("sm120_fp8_mqa_logits", "attention", "indexer"),
    ("flash_mla_sparse_fwd_kernel", "attention", "sparse"),
    ("fused_moe_kernel", "moe", "grouped_gemm"),
    ("deep_gemm::fp8_m_grouped_gemm_nt_masked", "moe", "grouped_gemm"),
    ("moe_align_block_size_kernel", "moe", "dispatch"),
    ("biased_grouped_topk_kernel", "moe", "gate"),
    ("moe_sum_reduce_kernel", "moe", "combine"),
    ("deep_ep::intranode::combine<8>", "communication", "deepep"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", "norm_rope",
     "norm"),
    ("fused_add_rmsnorm_kernel", "norm_rope", "norm"),
    ("apply_rotary_embedding_kernel", "norm_rope", "rope"),
    ("per_token_group_quant_8bit_kernel", "quant", "quant"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl>", "memory", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other", "other"),
])
def test_shipped_rules(name, cls, sub):
    got = classify_names([name]).row(0, named=True)
    assert (got["cls"], got["subclass"]) == (cls, sub)


def test_memcpy_events_by_category():
    got = classify_names(["Memcpy PtoP (Device -> Device)", "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"],
                         cats=["gpu_memcpy", "gpu_memcpy", "gpu_memset"])
    assert got["cls"].to_list() == ["communication", "memory", "memory"]


def test_user_rules_take_precedence_and_bad_regex_is_named():
    rules = load_rules([("moe", "grouped_gemm", r"^nvjet_sm90_tst_256x128"), ("mykernels", r"^my_custom_op")])
    got = classify_names(["nvjet_sm90_tst_256x128_64x4", "my_custom_op_v2", "nvjet_sm90_tst_64x32"], rules=rules)
    assert got["cls"].to_list() == ["moe", "mykernels", "gemm"]
    with pytest.raises(ValueError, match="invalid regex"):
        load_rules([("gemm", "nvjet[")])
    with pytest.raises(ValueError, match="expected"):
        load_rules([("only-one-field",)])


def test_every_rule_class_is_known():
    assert {r.cls for r in default_rules()} <= set(CLASSES)


def test_real_traces_nccl_kernels_are_communication(thirdparty: Path, h200x2: Path, tmp_path: Path):
    paths = [h200x2 / "traces/20261129203606-TP-0.trace.json.gz",
             thirdparty / "hta/nccl_parser_config/nccl_data.json.gz",
             thirdparty / "hta/trace_filter/sampled_rank-0.json.gz"]
    for p in paths:
        ev = load_trace(p, cache_dir=tmp_path).events
        k = ev.filter(pl.col("cat") == "kernel").select(pl.col("name").cast(pl.String)).unique()
        got = classify_names(k["name"].to_list())
        nccl = got.filter(pl.col("name").str.contains("nccl"))
        assert nccl.height > 0 and set(nccl["cls"].to_list()) == {"communication"}, p.name
        assert got.filter(~pl.col("name").str.contains("nccl"))["cls"].is_in(["communication"]).sum() == 0, p.name


def test_short_name_drops_signature():
    assert short_name("void foo::bar<int, (bool)1>(int, float*)") == "foo::bar<int, (bool)1>"
    assert short_name("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    # a namespace in parentheses is not the parameter list: the name is not cut to "at::native::"
    assert short_name("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, int)") == \
        "at::native::anonymous_namespace::cunn_SoftMaxForward<4, float>"
