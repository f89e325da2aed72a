"""Fixtures (an isolated model cache, one intra-op thread, the speculators package), quiet libraries, and the skip
hook of the markers.

Builders shared by the test modules live in tests/helpers/; nothing imports this file as a module.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from types import SimpleNamespace

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The CPU fast path's layout plans and bandwidth probe, timed under a test run's load, stay out of the user's cache.
os.environ.setdefault("SPECDISTILL_CPU_PLANS", tempfile.mkdtemp(prefix="specdistill-cpu-plans-"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`gpu` tests skip without CUDA, `chromium` tests without chromium, unless demanded (SPECDISTILL_REQUIRE_GPU=1:
    benchmarks/gpu_smoke.sh; SPECDISTILL_REQUIRE_CHROMIUM=1: CI), where the missing piece fails the test instead of
    hiding it."""
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            if os.environ.get("SPECDISTILL_REQUIRE_GPU") == "1":
                pytest.fail("needs a CUDA GPU, and SPECDISTILL_REQUIRE_GPU=1 forbids skipping it", pytrace=False)
            pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("chromium") and shutil.which("chromium") is None:
        if os.environ.get("SPECDISTILL_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not found: apt-get install chromium", pytrace=False)
        pytest.skip("needs headless Chromium: apt-get install chromium")


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh SPECDISTILL_CACHE so conversions, random models and CPU layout plans are built by the test itself."""
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDISTILL_CPU_PLANS", raising=False)  # plans in this cache too (cpu-plans/)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: thread wake-ups cost more than the maths there."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def speculators():
    """The speculators package for the tests that check our EAGLE-3 heads against its own model (installed by `make
    install` with --no-deps, its CLI's imports beside it); CI sets SPECDISTILL_REQUIRE_SPECULATORS=1, so there a
    missing package fails instead of skipping."""
    try:
        with warnings.catch_warnings():  # its import torch.compiles a module, which wakes torch's own deprecations
            warnings.filterwarnings("ignore", message=".*torch.jit.script_method", category=DeprecationWarning)
            import typer
            from speculators.cli import app
            from speculators.config import SpeculatorsConfig, VerifierConfig
            from speculators.models.eagle3 import Eagle3SpeculatorConfig
            from speculators.models.eagle3.core import Eagle3DraftModel
            from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError:
        from helpers.runs import require_speculators

        require_speculators()
    return SimpleNamespace(
        typer=typer, app=app, SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
        Eagle3SpeculatorConfig=Eagle3SpeculatorConfig, Eagle3DraftModel=Eagle3DraftModel,
        GreedyTokenProposalConfig=GreedyTokenProposalConfig,
    )  # fmt: skip
