"""The GPU checks, checked on the CPU (issue 22): the one-GPU script refuses a machine without CUDA, a required gpu
test fails instead of skipping, the GPU bench captures its graphs before the timed calls and its checks fail loudly,
and the CUDA distribution tests' reference has no nucleus boundary within bf16 noise."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.models import gpu_llama, tiny_llama
from helpers.runs import load_benchmark
from helpers.stats import CUDA_SAMPLING, JOINT_PROMPTS

from specdec_runtime.llama import Llama

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = {"CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}  # this machine's view on any machine


@pytest.fixture(scope="module")
def gpu_bench():
    return load_benchmark("gpu_bench")


# --------------------------------------------------------------------------------------------------- gpu_smoke.sh


def test_gpu_smoke_stops_at_once_without_cuda_and_writes_nothing(tmp_path):
    out, runs = tmp_path / "out", ROOT / "runs" / "gpu-smoke"
    before = sorted(runs.iterdir()) if runs.is_dir() else []
    start = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_smoke.sh"), str(out)],
        env={**os.environ, **NO_CUDA},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and time.monotonic() - start < 60
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "FAIL: torch.cuda.is_available() is False" in done.stderr and "needs a CUDA GPU" in done.stderr
    assert not out.exists() and (sorted(runs.iterdir()) if runs.is_dir() else []) == before


def test_a_required_gpu_test_fails_instead_of_skipping():
    """What gpu_smoke.sh sets for its gpu-marked tests: a test that cannot run is a failure, not a skip."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_runtime_gpu.py"],
        cwd=ROOT,
        env={**os.environ, **NO_CUDA, "SPECDISTILL_REQUIRE_GPU": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "forbids skipping" in done.stdout, done.stdout[-2000:]
    assert "skipped" not in done.stdout.splitlines()[-1]


# ---------------------------------------------------------------------------------------------------- gpu_bench.py


def compact_pair():
    target = tiny_llama(seed=0)
    return target, Llama.from_hf(target), Llama.from_hf(target)


def test_the_bench_captures_its_graphs_after_the_warm_up_before_any_timed_call(gpu_bench, monkeypatch):
    events = []
    capture, paired_runs = gpu_bench.capture_graphs, gpu_bench.paired_runs

    def recording_capture(*args, **kwargs):
        events.append("capture")
        return capture(*args, **kwargs)

    def recording_runs(run, **kwargs):
        return paired_runs(lambda *a: events.append("timed") or run(*a), **kwargs)

    monkeypatch.setattr(gpu_bench, "capture_graphs", recording_capture)
    monkeypatch.setattr(gpu_bench, "paired_runs", recording_runs)
    hf, target, draft = compact_pair()
    row = gpu_bench.paired_ab(target, draft, [[1, 2, 3], [4, 5]], hf_target=hf, gamma=2, max_new_tokens=4, repeats=1)
    assert events == ["capture"] + ["timed"] * 4, events  # 2 prompts x 2 arms x 1 repeat
    assert gpu_bench.row_failures("compact_graphs_on", row, on_cuda=False) == []


def test_a_graph_captured_inside_a_timed_call_fails_the_bench(gpu_bench, monkeypatch):
    """The check sees what a capture inside a timed call leaves: a new entry in the model's graphs."""
    generate = gpu_bench.generate

    def capturing_generate(target, draft, *args, **kwargs):
        if draft is not None:  # as a capture would: a graph of a width or row count the warm-up did not see
            by_rows = target.graphs.setdefault(99, {})
            by_rows[len(by_rows) + 1] = (object(), object(), object())  # (graph, inputs, logits)
        return generate(target, draft, *args, **kwargs)

    hf, target, draft = compact_pair()
    monkeypatch.setattr(gpu_bench, "generate", capturing_generate)
    row = gpu_bench.paired_ab(target, draft, [[1, 2, 3]], hf_target=hf, gamma=2, max_new_tokens=4, repeats=2)
    assert len(row["captures_in_timed_calls"]) == 2  # the warm-up's capture is not a timed one
    failures = gpu_bench.row_failures("eagle3", row, on_cuda=False)
    assert failures and all("captured inside timed call" in line for line in failures)


def test_a_greedy_row_parting_off_a_tie_fails_the_bench(gpu_bench):
    hf, prompt = gpu_llama(0, device="cpu"), [5, 17, 3]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)  # fmt: skip
    want = out.sequences[0, 3:].tolist()
    gaps = [float(x[0].topk(2).values.diff().abs() / x[0].abs().max()) for x in out.logits]  # relative top-two gap
    clear = max(range(len(gaps)), key=gaps.__getitem__)  # the step furthest from a tie
    assert gaps[clear] > gpu_bench.TIE
    assert gpu_bench.parting(hf, prompt, want, want) is None
    wrong = want[:clear] + [(want[clear] + 1) % 64] + want[clear + 1 :]
    assert f"parted at token {clear}" in gpu_bench.parting(hf, prompt, wrong, want)
    assert "tokens against" in gpu_bench.parting(hf, prompt, want[:-1], want)


def good_row(**changes) -> dict:
    row = {"speedup": 1.5, "speedup_ci": [1.4, 1.6], "acceptance_rate": 0.95, "efficiency": 0.97}
    checked = {"greedy_partings": [], "captures_in_timed_calls": [], "target_graphs_copy_aux": True, "head_graphs": [1]}
    return row | checked | changes


@pytest.mark.parametrize(
    "key,row,on_cuda,says",
    [
        ("compact_graphs_on", good_row(speedup=math.inf), True, "not finite"),
        ("compact_graphs_on", good_row(speedup=None, speedup_ci=None), False, "not finite"),
        ("compact_graphs_on", good_row(speedup_ci=[1.6, 1.7]), True, "outside its interval"),
        ("compact_graphs_on", good_row(acceptance_rate=None), True, "acceptance_rate None"),
        ("hf_generic_path", good_row(greedy_partings=["(unit 0, repeat 0): parted at token 3"]), False, "greedy row"),
        ("self_draft", good_row(acceptance_rate=0.5), False, "accepted 0.500"),
        ("self_draft", good_row(efficiency=1.3), True, "measurement bug"),
        ("eagle3", good_row(target_graphs_copy_aux=False), True, "aux-state copies"),
        ("eagle3", good_row(head_graphs=[]), True, "drafting step did not run as a CUDA graph"),
        ("eagle3", {"error": "Traceback ...\nValueError: EAGLE-3 takes exactly 3 aux layers\n"}, False, "raised"),
    ],
)
def test_the_bench_checks_fail_loudly(gpu_bench, key, row, on_cuda, says):
    assert gpu_bench.row_failures(key, good_row(), on_cuda=True) == []
    failures = gpu_bench.row_failures(key, row, on_cuda)
    assert len(failures) == 1 and says in failures[0] and failures[0].startswith(key), failures


def test_the_efficiency_bound_is_a_cuda_check(gpu_bench):
    """A shared CPU's timings are noise: the dry run reports the self draft's efficiency without judging it."""
    assert gpu_bench.row_failures("self_draft", good_row(efficiency=1.3), on_cuda=False) == []


def test_the_bench_dry_run_passes_its_checks_with_an_eagle3_section(gpu_bench, tmp_path, capsys):
    path = tmp_path / "bench.json"
    args = ["--small", "--num-prompts", "2", "--max-new-tokens", "4", "--repeats", "1", "--sections", "self", "eagle3"]
    assert gpu_bench.main([*args, "--json", str(path)]) == 0, capsys.readouterr().err
    result = json.loads(path.read_text())
    assert result["sections"] == ["self_draft", "eagle3"] and result["checks"]["failed"] == []
    assert result["checks"]["timing_bounds_enforced"] is False  # the dry run shares the CPU
    eagle3 = result["eagle3"]
    assert eagle3["speedup_ci"][0] <= eagle3["speedup"] <= eagle3["speedup_ci"][1] and eagle3["peak_memory_bytes"] > 0
    assert eagle3["greedy_partings"] == [] and eagle3["target_only"]["new_tokens"] == 2 * 4
    assert len(result["summary"]) == 2 and "checks: all passed" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- the CUDA test models


def nucleus_margin(logits: torch.Tensor, top_p: float) -> float:
    """(N, V) logits at temperature 1 -> how close top_p comes to any cumulative probability of the sorted tokens
    (inf without a nucleus): a token that close to the boundary falls in or out of it under bf16 rounding."""
    if top_p >= 1:
        return math.inf
    cumulative = logits.float().softmax(-1).sort(-1, descending=True).values.cumsum(-1)  # (N, V)
    return float((cumulative - top_p).abs().min())


def test_the_cuda_distribution_tests_have_no_nucleus_boundary_within_bf16_noise():
    """test_bf16_graphs_distribution and test_tree_distribution_on_cuda compare bf16 draws with an fp32 reference of
    this model: bf16 moves its probabilities by ~0.5 %, so no cumulative probability may sit that close to top_p."""
    model = gpu_llama(0, vocab_size=12, init=0.1, device="cpu")
    assert CUDA_SAMPLING.temperature == 1.0
    for prompt in JOINT_PROMPTS.values():  # the contexts of the first and the second token
        contexts = torch.tensor([prompt + [y] for y in range(12)])
        with torch.no_grad():
            logits = torch.cat([model(input_ids=torch.tensor([prompt])).logits[:, -1], model(contexts).logits[:, -1]])
        assert nucleus_margin(logits, CUDA_SAMPLING.top_p) > 0.01
