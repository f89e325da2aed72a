"""Tiny training runs: teacher data, configs, reference runs, weight/log comparisons, launchers, offline W&B runs and
small real filesystems (read-only or nearly full)."""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

# A child process's prelude (dedented source) that stops the run for two minutes right after it writes a checkpoint:
# a SIGKILL sent once the first checkpoint is complete then always lands between two steps of a live run.
PAUSE_AFTER_CHECKPOINT = """
import time
import train.checkpoint
_save = train.checkpoint.save_checkpoint
def _save_then_wait(*args, **kwargs):
    path = _save(*args, **kwargs)
    time.sleep(120)
    return path
train.checkpoint.save_checkpoint = _save_then_wait
"""


TESTS = Path(__file__).resolve().parent.parent  # tests/


def make_split(path: Path, teacher, n: int, *, seed: int, top_k: int | None, prompt_topk: bool = False) -> Path:
    """A finished teacher dataset in the data contract's format: random prompt/response ids, optional top-k cache
    from a real teacher forward (so cached and online targets agree), of the response tokens or, with `prompt_topk`,
    of every predicted token (`topk_start` 1, as distill.loss_on_prompt needs)."""
    import datasets

    from distill.data import COMPLETE, TOPK_START, features

    g = torch.Generator().manual_seed(seed)
    cols = {"id": [], "category": [], "input_ids": [], "prompt_len": []}
    cols |= {"topk_ids": [], "topk_logprobs": []} if top_k else {}
    cols |= {TOPK_START: []} if top_k and prompt_topk else {}
    for i in range(n):
        P, R = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(2, 10, (1,), generator=g))
        ids = torch.randint(3, teacher.config.vocab_size, (P + R,), generator=g)
        cols["id"].append(f"p{i}#0")
        cols["category"].append("test")
        cols["input_ids"].append(ids.tolist())
        cols["prompt_len"].append(P)
        if top_k:
            with torch.no_grad():
                logprobs = torch.log_softmax(teacher(ids[None]).logits[0].float(), dim=-1)  # (T, V)
            start = 1 if prompt_topk else P  # the token the first row predicts
            values, indices = logprobs[start - 1 : P + R - 1].topk(top_k, dim=-1)  # position t predicts token t + 1
            cols["topk_ids"].append(indices.tolist())
            cols["topk_logprobs"].append(values.tolist())
            if prompt_topk:
                cols[TOPK_START].append(start)
    datasets.Dataset.from_dict(cols, features=features(top_k, None, prompt_topk)).save_to_disk(str(path))
    (path / COMPLETE).write_text("")
    return path


def make_teacher_data(
    root: Path, teacher, *, n_train: int = 16, n_eval: int = 5, top_k: int | None = 4, prompt_topk: bool = False
):
    """Training and validation splits (`make_split`); with `prompt_topk` the training split's cache has prompt rows,
    and its folder another name (the validation split's never has them, as the data stage writes it)."""
    from distill.data import TeacherData

    name = "teacher-prompt-test" if prompt_topk else "teacher-test"
    return TeacherData(
        train=make_split(root / name, teacher, n_train, seed=0, top_k=top_k, prompt_topk=prompt_topk),
        validation=make_split(root / "teacher-eval-test", teacher, n_eval, seed=1, top_k=top_k),
    )


def train_config(out: Path, *overrides: str):
    """A config for a few-step run of a 2-layer student of random:tiny-llama on CPU, no W&B."""
    from specdistill.config import load_config

    base = [
        f"output_dir={out}",
        "target.model=random:tiny-llama",
        "target.device=cpu",
        "draft.num_layers=2",
        "train.max_steps=2",
        "train.batch_size=2",
        "train.grad_accum=1",
        "train.max_seq_len=64",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        "train.eval_every=1",
        "train.save_every=1",
        "train.log_every=1",
        "tracking.backend=none",
        "data.max_new_tokens=6",
    ]
    return load_config(None, [*base, *overrides])


def tiny_setup(root: Path):
    """(teacher, tokenizer, teacher data) with the random:tiny-llama target from the (isolated) model cache."""
    from specdec_runtime.loading import load_model

    teacher, tokenizer = load_model("random:tiny-llama", device="cpu")
    return teacher, tokenizer, make_teacher_data(root, teacher)


def reference_run(tmp_path_factory, name: str, *overrides: str) -> tuple[Path, object, Path]:
    """(root, teacher data, candidate folder) of one `draft` run in this process, for a module-scoped fixture; the
    model cache is root/cache, for the subprocess runs compared with it."""
    from specdistill.pipeline import distill_candidate as distill

    root = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDISTILL_CACHE", str(root / "cache"))
        teacher, tokenizer, data = tiny_setup(root)
        cand = distill(train_config(root / name, *overrides), "draft", data, teacher=teacher, tokenizer=tokenizer)
    return root, data, cand


def final_weights(cand: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(cand / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


ADAM_OUTLIERS = 1e-3  # see assert_same_weights


def assert_same_weights(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-4, outliers: float = 0.0
) -> None:
    """Equal up to float noise: every tensor within atol, but for at most an `outliers` share of its elements
    (`ADAM_OUTLIERS` where the two runs reduce in another order).

    Runs that reduce in another order (1 vs 2 processes, accumulated micro-batches) differ by float rounding, and
    the rounding depends on the CPU's kernels (AVX2 vs AVX-512). Adam turns a gradient at the scale of its eps
    (1e-8) into a step of up to lr whatever its sign, so the rare element with such a gradient moves by rounding
    noise: 1 of 16,576 elements was 1.4e-4 apart on an AVX-512 machine. A real defect (a lost micro-batch, a wrong
    normalisation) moves most elements, and the loss and gradient norm (`assert_same_logs`) as well.
    `atol=0` compares bit for bit (resume), with no outliers."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name].float(), b[name].float()
        assert x.shape == y.shape, f"{name}: {tuple(x.shape)} vs {tuple(y.shape)}"
        if atol == 0:
            assert torch.equal(x, y), f"{name}: {(x != y).sum().item()} elements differ"
            continue
        off = (x - y).abs() > atol + 1e-5 * y.abs()
        allowed = int(outliers * x.numel())
        assert off.sum().item() <= allowed, (
            f"{name}: {off.sum().item()} of {x.numel()} elements differ by more than {atol} (allowed {allowed}); "
            f"largest {(x - y).abs().max().item():.3g}"
        )


def first_step_gradients(run) -> list[torch.Tensor]:
    """The gradients the first optimizer step of `run()` applies (after accumulation and clipping), in parameter
    order: what gradient accumulation and data parallelism must get right, free of Adam's amplification."""
    grads: list[torch.Tensor] = []

    def record(optimizer, args, kwargs):
        if not grads:
            grads.extend(p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"])

    handle = register_optimizer_step_pre_hook(record)
    try:
        run()
    finally:
        handle.remove()
    return grads


def assert_same_logs(a: list[dict], b: list[dict]) -> None:
    """Same loss, gradient norm and validation metrics at every logged step. Adam hides a constant gradient scale
    in the weights; the gradient norm does not."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in x.keys() - {"step", "train/tokens_per_s"}:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)


def metric_rows(cand: Path) -> list[dict]:
    return [json.loads(line) for line in (cand / "metrics.jsonl").read_text().splitlines()]


def accelerate_launcher(config: str) -> tuple[str, ...]:
    """`python -m accelerate.commands.launch` arguments for the shipped configs/accelerate/`config` on 2 processes,
    on a free port (a fixed one would clash with a run still releasing it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    path = TESTS.parent / "configs" / "accelerate" / config
    return ("-m", "accelerate.commands.launch", "--config_file", str(path), "--num_processes", "2",
            "--main_process_port", port)  # fmt: skip


def read_wandb_records(run_file: Path) -> list:
    """Records of a `.wandb` transaction log: a 7-byte header, then LevelDB-log framed protobuf `Record`s in 32 KiB
    blocks (chunk header: crc32 u32, length u16, type u8 with 1 = full, 2 = first, 3 = middle, 4 = last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def offline_run(run_dir: Path, timeout: float = 60.0) -> tuple[list[dict], list, bytes]:
    """(history rows, artifact records, raw bytes) of the single offline W&B run under `run_dir`.

    `run.finish()` can return before wandb-core has flushed the transaction log, so wait for its exit record.
    """
    from google.protobuf.message import DecodeError

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = read_wandb_records(run_file)
        except DecodeError:  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    return history, artifacts, run_file.read_bytes()


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the folder is not a package): its functions are tested like any other."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TESTS.parent / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_speculators() -> None:
    """Fail (CI: SPECDISTILL_REQUIRE_SPECULATORS=1) or skip when the speculators package is missing; call it from
    the `except ImportError` of the test's own imports of speculators."""
    import os
    import sys

    error = sys.exc_info()[1]
    if os.environ.get("SPECDISTILL_REQUIRE_SPECULATORS") == "1":
        pytest.fail(f"speculators not importable ({error}): `make install` puts it in with --no-deps", pytrace=False)
    pytest.skip(f"speculators not installed ({error}); `make install` adds it")


@contextlib.contextmanager
def small_filesystem(path: Path, *options: str):
    """A real tmpfs mounted at `path` (size and ro options); skipped where this process may not mount one."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.decode().strip()[:120]}): needs root with CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# Prompt files cut short, with what the error must say after the file's name: (file name, bytes, message tail).
TRUNCATED_PROMPT_FILES = [
    (
        "cut.json",
        b'[{"prompt": "a"},\n {"prompt": "b"',
        " is not valid JSON (Expecting ',' delimiter: line 2 column 16): the file ends early (truncated?)",
    ),
    (
        "cut.jsonl",
        b'{"prompt": "a"}\n{"prompt": "b',
        ": line 2 is not valid JSON (Unterminated string starting at: column 12): the file ends there (truncated?)",
    ),
]
