"""Past one machine (issue 29): two "nodes" on one host, each a launcher invocation of its own (--nnodes 2
--node_rank N, or --num_machines 2 --machine_rank N) with one process over gloo, its own model cache (HF_HOME,
SPECDISTILL_CACHE) and its own TMPDIR; the nodes share only output_dir. There rank and local rank differ and no
two processes share a model cache, and every stage must write what a single-node 2-process launch writes:

- `data` (torchrun): the same teacher-data folders, row for row;
- `distill`, DDP (torchrun): node 0 SIGKILLed with its worker right after the step-2 checkpoint, node 1 left to
  stop, then both launched again: the logs, the last checkpoint and best/ of a straight single-node run;
- `distill` with the teacher sharded by FSDP2 (`accelerate launch --num_machines 2 --machine_rank N`): the same;
- `eval` through configs/slurm/multinode.sbatch (srun and scontrol stood in for on this host): the same report.

And two that must fail: a write keyed on the local rank (accelerate's is_main_process answering
is_local_main_process, patched into both nodes) fails these checks, and an output_dir that one node does not see is
refused by every node before any model loads. Without file locks (some network filesystems) a run goes on, warned.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from helpers.runs import PAUSE_AFTER_CHECKPOINT, assert_same_logs, assert_same_weights, final_weights, metric_rows
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "configs" / "smoke.yaml"
SBATCH = ROOT / "configs" / "slurm" / "multinode.sbatch"
CPU_2PROC = ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"
SETTINGS = ("candidates=[]", "tracking.backend=none")  # one candidate, `draft`, of smoke.yaml's root sections
FSDP2 = ("train.shard_teacher=always",)  # the FSDP2 path that runs on gloo (accelerate shards students on GPUs only)
STEPS = 4  # smoke.yaml's train.max_steps; it validates and checkpoints (keep_last 1) every 2
CAND = Path("candidates") / "draft"
TIMEOUT_S = 600

# The defect the checks must catch: "main process" decided by the local rank, so each node's first process writes
# to the shared output_dir (metrics, checkpoints, best/) as if it were the only one.
LOCAL_RANK_IS_MAIN = """
import accelerate.state
accelerate.state.PartialState.is_main_process = property(lambda self: self.is_local_main_process)
"""

# srun and scontrol on one host: the job step's command once per "node", each with folders of its own.
SRUN = """#!/usr/bin/env bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done  # srun's own options
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  home="$NODES/node$node"
  SLURM_NODEID=$node SLURM_PROCID=$node HF_HOME="$home/hf" SPECDISTILL_CACHE="$home/cache" TMPDIR="$home/tmp" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && printf '127.0.0.1\\n127.0.0.1\\n'
"""


@dataclass
class Cluster:
    """Two nodes' worth of folders under `root`: node<N>/{hf,cache,tmp}, the disks only that node has."""

    root: Path

    def env(self, node: int) -> dict[str, str]:
        home = self.root / f"node{node}"
        for name in ("hf", "cache", "tmp"):
            (home / name).mkdir(parents=True, exist_ok=True)
        return base_env() | {"HF_HOME": str(home / "hf"), "SPECDISTILL_CACHE": str(home / "cache"),
                             "TMPDIR": str(home / "tmp")}  # fmt: skip


def base_env() -> dict[str, str]:
    return os.environ | {
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def stage(name: str, out: Path, *overrides: str) -> tuple[str, ...]:
    """`specdistill` arguments: the stage on smoke.yaml's one candidate in `out`."""
    return (name, str(SMOKE), f"output_dir={out}", *SETTINGS, *overrides)


def torchrun(node: int, port: str, entry: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, *entry]  # fmt: skip


def accelerate(node: int, port: str, entry: tuple[str, ...]) -> list[str]:
    """The shipped cpu_2proc.yaml (torchrun's launcher; on a CPU machine gloo), one process on each machine."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_2PROC), "--num_machines",
            "2", "--machine_rank", str(node), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
            "--main_process_port", port, *entry]  # fmt: skip


def module(*args: str) -> tuple[str, ...]:
    return ("-m", "specdistill", *args)


def entry_script(folder: Path, prelude: str) -> Path:
    """A script a launcher runs in place of `-m specdistill`: `prelude` first, in every process, then the CLI."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "specdistill_entry.py"
    script.write_text(prelude + "\nimport sys\n\nfrom specdistill.cli import main\n\nsys.exit(main(sys.argv[1:]))\n")
    return script


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a live launcher and everything it started, as a lost node loses them: torchrun starts each worker in
    a session of its own, so the tree is walked rather than a process group killed."""
    if proc.poll() is None:  # not reaped yet, so its pid is still its own
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = psutil.Process(proc.pid)
            for p in [*parent.children(recursive=True), parent]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
    proc.wait(timeout=30)


@contextlib.contextmanager
def launched(commands: list[tuple[list[str], dict]], logs: Path) -> Iterator[list[subprocess.Popen]]:
    """Start each (command, env) as a node, its output in logs/node<N>.log; whatever is still alive on leaving is
    killed, on a failure too."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for node, (cmd, env) in enumerate(commands):
            with open(logs / f"node{node}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        yield procs
    finally:
        for proc in procs:
            kill_tree(proc)


def read_logs(logs: Path) -> str:
    return "".join(f"\n== {p.name} ==\n{p.read_text()}" for p in sorted(logs.glob("*.log")))


def two_nodes(cluster: Cluster, launcher: Callable, entries: list[tuple[str, ...]], logs: Path) -> tuple[list, str]:
    """Launch node 0 with entries[0] and node 1 with entries[1]; (exit codes, both logs) once both have ended."""
    port = free_port()
    commands = [(launcher(node, port, entry), cluster.env(node)) for node, entry in enumerate(entries)]
    with launched(commands, logs) as procs:
        deadline = time.monotonic() + TIMEOUT_S
        try:
            codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the nodes ran past {TIMEOUT_S} s (killed):{read_logs(logs)[-4000:]}")
    return codes, read_logs(logs)


def one_node(cluster: Cluster, *args: str) -> None:
    """The single-node reference: torchrun --standalone, 2 processes, node 0's model cache."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *module(*args)]
    r = subprocess.run(cmd, env=cluster.env(0), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def same_text(a: Path, b: Path) -> None:
    assert a.read_text() == b.read_text(), f"{a} differs from {b}"


def candidate_differences(one: Path, two: Path) -> list[str]:
    """What differs between two candidate folders, one line each (empty: nothing): the logged rows, the last
    checkpoint's weights, best/'s weights and DONE. Weights are compared allclose, as in the other multi-process
    tests; both runs are 2 processes over gloo, so in practice they are equal bit for bit."""
    checks = {
        "metrics.jsonl": lambda: assert_same_logs(metric_rows(two), metric_rows(one)),
        f"step {STEPS}": lambda: assert_same_weights(final_weights(two, STEPS), final_weights(one, STEPS)),
        "best/": lambda: assert_same_weights(*(load_file(c / "best" / "model.safetensors") for c in (two, one))),
        "DONE": lambda: same_text(two / "DONE", one / "DONE"),
    }
    found = []
    for name, check in checks.items():
        try:
            check()
        except Exception as e:  # a broken run's files may be missing, torn or other: each is a finding
            found.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    return Cluster(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def single(cluster) -> dict[str, Path]:
    """Single-node 2-process runs: `distill` (its data stage included) and `eval` in ddp/, and `distill` with a
    sharded teacher in fsdp/ (the same data, copied)."""
    ddp, fsdp = cluster.root / "one" / "ddp", cluster.root / "one" / "fsdp"
    one_node(cluster, *stage("distill", ddp))
    shutil.copytree(ddp / "data", fsdp / "data")
    one_node(cluster, *stage("distill", fsdp, *FSDP2))
    one_node(cluster, *stage("eval", ddp))
    return {"ddp": ddp, "fsdp": fsdp}


@pytest.fixture(scope="module")
def two_node_data(cluster) -> Path:
    """output_dir of `specdistill data` on two nodes (torchrun)."""
    out = cluster.root / "two" / "ddp"
    codes, log = two_nodes(cluster, torchrun, [module(*stage("data", out))] * 2, cluster.root / "logs" / "data")
    assert codes == [0, 0], log[-4000:]
    return out


@pytest.fixture(scope="module")
def two_node_ddp(cluster, two_node_data) -> tuple[Path, str]:
    """(output_dir, log of the resumed launch) of `distill` (DDP) on two nodes: node 0, whose rank 0 pauses right
    after writing the step-2 checkpoint, is SIGKILLed with its worker; node 1 is left to stop on its own (killed if
    it has not within a minute); then both nodes are launched again and resume."""
    out, logs = two_node_data, cluster.root / "logs" / "ddp-killed"
    marker = out / CAND / "checkpoints" / "step-000002" / "COMPLETE"
    paused = (str(entry_script(cluster.root / "pause", PAUSE_AFTER_CHECKPOINT)), *stage("distill", out))
    port = free_port()
    with launched([(torchrun(node, port, paused), cluster.env(node)) for node in (0, 1)], logs) as procs:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.is_file() and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p.poll() is None for p in procs]
        kill_tree(procs[0])
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[1].wait(timeout=60)
    assert marker.is_file() and all(alive), read_logs(logs)[-4000:]
    assert not (out / CAND / "DONE").exists() and not (out / CAND / "checkpoints" / f"step-{STEPS:06d}").exists()

    codes, log = two_nodes(cluster, torchrun, [module(*stage("distill", out))] * 2, cluster.root / "logs" / "ddp")
    assert codes == [0, 0], log[-4000:]
    return out, log


@pytest.mark.slow
def test_the_data_stage_on_two_nodes_writes_what_one_node_writes(cluster, single, two_node_data):
    from distill.data import load_teacher_data

    one, two = single["ddp"] / "data", two_node_data / "data"
    names = sorted(p.name for p in two.glob("teacher-*"))
    assert len(names) == 2 and names == sorted(p.name for p in one.glob("teacher-*")), (names, list(one.iterdir()))
    for name in names:
        assert load_teacher_data(two / name).to_list() == load_teacher_data(one / name).to_list(), name
        assert not (two / name / "shards").exists()
    for node in (0, 1):  # each node filled its own model cache: nothing crossed between them but output_dir
        assert (cluster.root / f"node{node}" / "cache" / "random" / "tiny-llama" / "config.json").is_file()


@pytest.mark.slow
def test_a_node_killed_mid_distill_then_both_resumed_train_like_one_node(single, two_node_ddp):
    out, log = two_node_ddp
    cand = out / CAND
    assert f"resumed draft from {cand / 'checkpoints' / 'step-000002'}" in log, log[-3000:]
    assert candidate_differences(single["ddp"] / CAND, cand) == []
    state = json.loads((cand / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["world_size"] == 2


@pytest.mark.slow
def test_a_teacher_sharded_over_two_accelerate_machines_trains_like_one_node(cluster, single, two_node_data):
    out = cluster.root / "two" / "fsdp"
    shutil.copytree(two_node_data / "data", out / "data")
    entry = module(*stage("distill", out, *FSDP2))
    codes, log = two_nodes(cluster, accelerate, [entry] * 2, cluster.root / "logs" / "fsdp")
    assert codes == [0, 0], log[-4000:]
    # accelerate's print: once per node (each node's first process), so once in each node's log
    assert log.count("teacher sharded over 2 processes (FSDP2)") == 2, log[-3000:]
    assert candidate_differences(single["fsdp"] / CAND, out / CAND) == []


@pytest.mark.slow
def test_eval_through_the_slurm_script_on_two_nodes_matches_one_node(cluster, single, two_node_ddp):
    out, _ = two_node_ddp
    stubs = cluster.root / "slurm-bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = base_env() | {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "NODES": str(cluster.root),
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_NNODES": "2",
        "GPUS_PER_NODE": "1",
        "MASTER_PORT": free_port(),
        "PYTHON": sys.executable,
    }
    logs = cluster.root / "logs" / "eval"
    with launched([(["bash", str(SBATCH), *stage("eval", out)], env)], logs) as (job,):
        job.wait(timeout=TIMEOUT_S)  # the srun stand-in's own folders per node are the ones the stages above filled
    assert job.returncode == 0, read_logs(logs)[-4000:]

    one, two = (json.loads((d / "eval" / "report.json").read_text()) for d in (single["ddp"], out))
    assert [c["name"] for c in two["candidates"]] == [c["name"] for c in one["candidates"]] == ["draft"]
    assert two["prompts"] == one["prompts"]
    settings = [r["candidates"][0]["settings"] for r in (one, two)]
    assert len(settings[1]) == len(settings[0]) > 0
    for a, b in zip(*settings):
        assert [b[k] for k in ("temperature", "draft_rule", "num_draft_tokens")] == [
            a[k] for k in ("temperature", "draft_rule", "num_draft_tokens")
        ]
        if a["temperature"] == 0:  # greedy: the same weights and prompts give the same tokens and decisions
            for key in ("acceptance_rate", "mean_accepted_length", "new_tokens", "target_forwards"):
                assert b[key] == pytest.approx(a[key]), key


@pytest.mark.slow
def test_a_write_keyed_on_the_local_rank_fails_these_checks(cluster, single, two_node_data):
    """The deliberately broken variant: each node's first process counts as the main one. Its run ends in an error
    or writes what the single-node run does not (every row of metrics.jsonl twice, racing best/ and checkpoint
    writes); either way the checks above fail. A one-minute process-group timeout bounds a hang."""
    out = cluster.root / "two" / "broken"
    shutil.copytree(two_node_data / "data", out / "data")
    script = entry_script(cluster.root / "broken", LOCAL_RANK_IS_MAIN)
    entry = (str(script), *stage("distill", out, "train.timeout_minutes=1"))
    codes, _ = two_nodes(cluster, torchrun, [entry] * 2, cluster.root / "logs" / "broken")
    found = candidate_differences(single["ddp"] / CAND, out / CAND)
    assert codes != [0, 0] or found, "two processes wrote output_dir as the main process, and no check noticed"


@pytest.mark.slow
def test_an_output_dir_one_node_does_not_see_is_refused_by_every_node_before_any_model_loads(tmp_path):
    """Node 1's output_dir is another folder: the same path on a disk of its own. Both nodes stop with one line
    naming the rank that cannot see rank 0's files, before either loads a model."""
    cluster = Cluster(tmp_path)
    shared, local = tmp_path / "shared" / "run", tmp_path / "node1" / "run"
    entries = [module(*stage("data", shared)), module(*stage("data", local))]
    codes, log = two_nodes(cluster, torchrun, entries, tmp_path / "logs")
    assert 0 not in codes, log[-4000:]
    for out in (shared, local):  # each node names its own output_dir
        assert f"specdistill: error: {out} is not shared by every process: rank 1" in log, log[-4000:]
    assert not (shared / "data").exists() and not (local / "data").exists()
    assert not any(any((tmp_path / f"node{node}" / "cache").iterdir()) for node in (0, 1))


def test_a_filesystem_without_file_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch, capsys):
    """Lustre mounted without `flock` answers flock() with ENOSYS, NFS without lockd with ENOLCK: the lock is a
    safeguard, so the run goes on and says what it lacks (it used to stop with a traceback)."""
    import errno
    import fcntl

    from specdistill.pipeline import dist_state, run_lock

    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with run_lock(tmp_path / "run", dist_state("cpu")):
        assert (tmp_path / "run" / ".specdistill.lock").is_file()
    assert f"has no file locks ({os.strerror(errno.ENOLCK)})" in capsys.readouterr().err
