"""The CPU fast path with compiled steps (`cpu.compile_steps`, `target.cpu_compile`): greedy output token-identical
to HF greedy decoding through chains, batches that shrink (padded to a power-of-two row count) and a refeed; one
compiled graph per (tokens per step, rows), reused across prompts of other lengths and across window widths; and
`capture_graphs` compiling ahead of the timed calls."""

import pytest
import torch
from helpers.models import LLAMA_PROMPTS, hf_greedy, tiny_llama

from distill.students import truncate_student
from specdec_runtime.ab import capture_graphs
from specdec_runtime.backends import BackendOptions, backend_name, fast_model
from specdec_runtime.cpu import CPU_COMPILED_BACKEND, compile_steps, cpu_model
from specdec_runtime.cpu_tune import layout_summary
from specdec_runtime.engine import generate
from specdistill.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def compiled():
    target = tiny_llama(0, layers=2)
    draft = truncate_student(target, [0])
    compiled = BackendOptions(cpu_compile=True)
    return target, fast_model(target, compiled), fast_model(draft, compiled, draft=True)


def test_compiled_speculative_and_target_only_greedy_match_hf(compiled):
    hf, target, draft = compiled
    assert backend_name(target) == CPU_COMPILED_BACKEND and backend_name(draft) == CPU_COMPILED_BACKEND
    for model in (target, draft):  # Inductor autotunes the GEMMs of packed weights; other layouts compiled poorly
        layouts = {layout for plan in layout_summary(model).values() for layout in plan.values()}
        assert layouts <= {"packed", "packed_bf16"}
    want = hf_greedy(hf, LLAMA_PROMPTS, 12)
    first = generate(target, draft, [LLAMA_PROMPTS[0]], num_draft_tokens=3, max_new_tokens=12)
    assert first.tokens == want[:1]
    capture_graphs(target, draft, batch_size=1, gamma=3)  # the refeed widths the first prompt did not reach
    before = graphs()
    for prompt, expected in zip(LLAMA_PROMPTS[1:], want[1:]):  # other prompt lengths: other window widths
        assert generate(target, draft, [prompt], num_draft_tokens=3, max_new_tokens=12).tokens == [expected]
        assert generate(target, None, [prompt], max_new_tokens=12).tokens == [expected]
    assert graphs() == before, "a prompt of another length compiled a step: the window width must stay dynamic"


def test_compiled_batches_shrink_through_padded_row_counts(compiled):
    hf, target, _ = compiled
    prompts = LLAMA_PROMPTS[:3]  # 3 rows: padded to the 4-row graph once the cache has 4 rows
    generate(target, None, LLAMA_PROMPTS, max_new_tokens=2)  # allocates 4 cache rows
    capture_graphs(target, None, batch_size=4, gamma=0)  # compiles every (width, rows) a shrinking batch reaches
    assert {1, 2} <= set(target.graphs) and set(target.graphs[1]) == {1, 2, 4}
    before = graphs()
    stops = {hf_greedy(hf, [prompts[1]], 12)[0][4]}  # row 1 stops early: the batch shrinks from 3 rows to 2
    got = generate(target, None, prompts, max_new_tokens=12, stop_token_ids=stops).tokens
    for row, expected in zip(got, hf_greedy(hf, prompts, 12)):
        cut = next((i + 1 for i, t in enumerate(expected) if t in stops), len(expected))
        assert row == expected[:cut]
    assert graphs() == before, "a timed call compiled a graph that capture_graphs should have compiled"


def test_compile_steps_needs_the_fast_path_and_the_config_says_so():
    with pytest.raises(ValueError, match="cpu_model"):
        compile_steps(tiny_llama(0))
    model = compile_steps(cpu_model(tiny_llama(0)))
    assert model.compiled_step is not None and model.cache_shape is None
    with pytest.raises(ValueError, match="target.cpu_fast_path=true or target.cpu_compile=false"):
        load_config(None, ["target.cpu_fast_path=false", "target.cpu_compile=true"])
    with pytest.raises(ValueError, match="target.cpu_fast_path=true or target.cpu_compile=false"):
        BackendOptions(cpu_fast_path=False, cpu_compile=True)
    assert load_config(None, ["target.cpu_compile=true"]).target.backend == BackendOptions(cpu_compile=True)
