"""benchmarks/verify_profile.py (issue 28): operators and Inductor kernels land in the category the table reports,
and the in-loop timing sees every target step of real generate calls by its width, then leaves the model as it was."""

import pytest
import torch
from helpers.models import LLAMA_PROMPTS, tiny_llama
from helpers.runs import load_benchmark

from specdec_runtime.backends import fast_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vp():
    return load_benchmark("verify_profile")


def test_operator_categories(vp):
    # eager kernels and the compiled graphs' kernels, as torch.profiler names them
    for name in ("aten::mm", "aten::bmm", "mkldnn::_linear_pointwise", "graph_2_gemm_m4n3072k576_kernel"):
        assert vp.category(name) == "gemm", name
    assert vp.category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    for name in ("aten::silu", "aten::_index_put_impl_", "graph_1_cpp_fused_mul_silu_split_view_7", "aten::cat"):
        assert vp.category(name) == "other", name


def test_in_loop_times_every_target_step_by_width(vp):
    hf = tiny_llama(0)
    target, draft = fast_model(hf), fast_model(tiny_llama(1), draft=True)
    prompts, gamma, new = [list(p) for p in LLAMA_PROMPTS[:2]], 3, 12
    with torch.no_grad():
        loop = vp.in_loop(target, draft, prompts, (), gamma, new)
    # target-only decodes one token per step (the first comes from the prefill); chains verify gamma + 1 tokens
    assert loop[1]["calls"] >= len(prompts) * (new - 1)
    assert loop[gamma + 1]["calls"] >= 1
    for r in loop.values():
        assert 0 < r["median_ms"] and r["slow"] <= r["calls"] and len(r["slowest_ms"]) <= 3
    assert "step" not in vars(target)  # the timing wrapper is gone: the next generate runs Llama.step itself
