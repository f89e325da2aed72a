"""Teacher data from a real OpenAI-compatible server (`data.generator: endpoint`): `transformers serve`, with
continuous batching, on localhost with a tiny model folder written here. No mock: the rows must be the server's,
the top-k the target's own forward, a second run a no-op, a server killed mid-run one clear error after which a rerun
writes every row exactly once, a wrong model name an error before any row is written.

The model's vocabulary is the 128 ASCII bytes plus ChatML's two markers, so any token sequence it emits decodes to
text that re-tokenizes to the very same ids: a text-only server (transformers serve returns no token ids) can be
checked token for token against our own runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import distill.endpoint as endpoint
from distill.config import DataConfig, EndpointConfig
from distill.data import fetch_teacher_responses, generate_teacher_data, load_teacher_data, topk_from_logits
from specdec_runtime.errors import UserError
from specdec_runtime.loading import load_model, stop_token_ids

TEACHER_ID = "tiny-ascii"
SERVE_START_S = 180  # import + load + bind, on a busy 2-core CPU


# ----------------------------------------------------------------------------------------------------------------
# The model, the server, the config


def ascii_model(folder: Path) -> Path:
    """A random 2-layer Llama whose tokens are the 128 ASCII bytes (byte-level, no merges), `<|im_start|>` (a plain
    added token, so decoding keeps it) and `<|im_end|>` (eos, the only special token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(128)} | {"<|im_start|>": 128, "<|im_end|>": 129}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_tokens(["<|im_start|>"])
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    torch.manual_seed(0)
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config = LlamaConfig(vocab_size=130, eos_token_id=129, pad_token_id=129, max_position_embeddings=512, **shape)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=129, pad_token_id=129)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def sampling_copy(folder: Path, out: Path) -> Path:
    """The model with `do_sample: true` in its generation config: transformers serve >= 5.25 starts continuous
    batching with the model's generation config, and a request's do_sample does not switch sampling on (5.24 took it
    from the first request)."""
    shutil.copytree(folder, out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(config | {"do_sample": True}))
    return out


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = ascii_model(tmp_path_factory.mktemp("model"))
    teacher, tokenizer = load_model(str(folder), device="cpu")
    return folder, teacher, tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`transformers serve FOLDER` with continuous batching on a free localhost port, ready when /health answers."""

    def __init__(self, folder: Path, log: Path, port: int | None = None):
        self.model, self.port = str(folder), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--device", "cpu", "--continuous-batching"]
        cmd += ["--cb-num-blocks", "128", "--cb-max-batch-tokens", "512"]  # sized from RAM, its first request takes 9 s
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.kill()
        pytest.fail(f"transformers serve did not answer within {SERVE_START_S} s:\n{log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and anything it started
            self.proc.wait(timeout=30)


def require_serving() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.fail("transformers serve needs fastapi, uvicorn and openai: run `make install`")


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    """One server for the module. Continuous batching fixes its sampling settings with the first request it gets,
    so every test on it asks with the same ones (greedy, `make_cfg`'s default)."""
    require_serving()
    srv = Server(target[0], tmp_path_factory.mktemp("serve") / "serve.log")
    yield srv
    srv.kill()


def write_prompts(path: Path, n: int, prefix: str) -> Path:
    topics = ("the moon", "bread", "a bicycle", "rain", "chess", "a violin", "tea", "owls")
    ask = "Tell me about" if prefix == "p" else "What is"
    rows = [{"id": f"{prefix}{i}", "prompt": f"{ask} {topics[i % 8]}" + "!" * i} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_cfg(tmp_path: Path, url: str, model: str, n_train: int = 8, **overrides) -> DataConfig:
    cfg = DataConfig(
        prompts=str(write_prompts(tmp_path / "train.jsonl", n_train, "p")),
        validation_prompts=str(write_prompts(tmp_path / "val.jsonl", 2, "e")),
        max_new_tokens=16,
        batch_size=4,
        shard_size=4,
        temperature=0.0,
        generator="endpoint",
        endpoint=EndpointConfig(url=url, model=model, max_concurrency=8, timeout_s=60, retries=1),
    )
    endpoint_keys = {k: overrides.pop(k) for k in list(overrides) if k in EndpointConfig.__dataclass_fields__}
    return dataclasses.replace(cfg, endpoint=dataclasses.replace(cfg.endpoint, **endpoint_keys), **overrides)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there


def parts(out: Path) -> list[Path]:
    return sorted(out.glob("*-responses-*/part-*.parquet"))


# ----------------------------------------------------------------------------------------------------------------
# End to end against the server


def test_rows_are_the_servers_the_top_k_is_a_local_forward_and_a_rerun_is_a_no_op(target, server, tmp_path, capsys):
    folder, teacher, tokenizer = target
    cfg = make_cfg(tmp_path, server.url, server.model, teacher_cache=True, teacher_cache_top_k=4)
    out = tmp_path / "data"
    stop_ids = list(stop_token_ids(teacher, tokenizer))
    # --fetch-only: the responses alone, no weights (what runs while vLLM holds the GPUs)
    stores = fetch_teacher_responses(
        tokenizer, cfg, out, context=512, stop_ids=stop_ids, teacher_id=TEACHER_ID, seed=0
    )  # fmt: skip
    said = capsys.readouterr().out
    assert f"endpoint {server.url} ('{server.model}'): text prompts (text+generation_config)" in said
    assert len(stores) == 2 and all(list(s.glob("part-*.parquet")) for s in stores)

    # Scoring and the shards: every response is stored, so the server (here: nobody) is never asked.
    gone = dataclasses.replace(cfg, endpoint=dataclasses.replace(cfg.endpoint, url=dead_url()))
    data = generate_teacher_data(teacher, tokenizer, gone, out, teacher_id=TEACHER_ID, seed=0)
    ds = load_teacher_data(data.train)
    assert ds["id"] == [f"p{i}#0" for i in range(8)]

    # The rows are the server's: its own answer to row 0's text prompt, re-tokenized, plus the stop token it matched.
    row0 = ds[0]
    prompt = tokenizer.decode(row0["input_ids"][: row0["prompt_len"]])
    body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    body["generation_config"] = json.dumps({"do_sample": False, "max_new_tokens": 16, "eos_token_id": stop_ids})
    answer = httpx.post(f"{server.url}/completions", json=body, timeout=60).json()["choices"][0]
    ids = tokenizer.encode(answer["text"], add_special_tokens=False)
    assert row0["input_ids"][row0["prompt_len"] :] == ids + (stop_ids if answer["finish_reason"] == "stop" else [])

    # ... and, greedy, token for token what our own runtime writes for the same prompts.
    runtime = dataclasses.replace(cfg, generator="runtime")
    local = generate_teacher_data(teacher, tokenizer, runtime, out, teacher_id=TEACHER_ID)
    assert load_teacher_data(local.train)["input_ids"] == ds["input_ids"]
    assert load_teacher_data(local.validation)["input_ids"] == load_teacher_data(data.validation)["input_ids"]

    # The top-k cache is our target's forward over prompt + response.
    for row in ds.with_format("torch"):
        x, p = row["input_ids"], int(row["prompt_len"])
        with torch.inference_mode():
            want_lp, want_ids = topk_from_logits(teacher(input_ids=x[None].long()).logits[:, p - 1 : -1], 4)
        assert torch.equal(row["topk_ids"][:, 0], want_ids[0, :, 0])
        torch.testing.assert_close(row["topk_logprobs"].float(), want_lp[0].float(), atol=2e-3, rtol=0)

    # Where the rows came from and what the server could not honour, in the dataset's metadata.
    generator = json.loads((data.train / ".complete").read_text())["generator"]
    assert generator["kind"] == "endpoint" and generator["model"] == server.model
    assert generator["dialects"] == ["text+generation_config"]
    assert generator["retokenized_rows"] == 8 and generator["token_count_mismatch_rows"] == 0
    assert any(note.startswith("token ids: the server returns text only") for note in generator["not_honoured"])

    # A second run is a no-op: cached, with no server to ask.
    capsys.readouterr()
    again = generate_teacher_data(teacher, tokenizer, gone, out, teacher_id=TEACHER_ID, seed=0)
    assert again == data and "teacher: cached" in capsys.readouterr().out


def test_a_wrong_model_name_fails_before_any_row_is_written(target, server, tmp_path):
    _, teacher, tokenizer = target
    cfg = make_cfg(tmp_path, server.url, "no-such-model")
    served = rf"{server.url} does not serve model 'no-such-model' \(it serves '{server.model}'\)"
    with pytest.raises(UserError, match=served):
        generate_teacher_data(teacher, tokenizer, cfg, tmp_path / "data", teacher_id=TEACHER_ID)
    assert not parts(tmp_path / "data") and not list((tmp_path / "data").glob("teacher-*/shards/shard-*"))


def test_a_server_that_is_not_there_is_one_clear_error(target, tmp_path):
    _, teacher, tokenizer = target
    url = dead_url()
    with pytest.raises(UserError, match=rf"cannot connect to the server at {url} \(connection refused\)"):
        generate_teacher_data(teacher, tokenizer, make_cfg(tmp_path, url, "m"), tmp_path / "d", teacher_id=TEACHER_ID)
    assert not parts(tmp_path / "d")


def test_a_server_killed_mid_run_is_one_error_and_a_rerun_writes_every_row_once(target, tmp_path, monkeypatch):
    """Sampled (and so unreproducible on transformers serve, whose seed is global): a row asked twice would
    differ, so the rows stored before the kill must come out of the rerun unchanged."""
    require_serving()
    folder, teacher, tokenizer = target
    folder = sampling_copy(folder, tmp_path / "sampling-model")
    monkeypatch.setattr(endpoint, "FLUSH_ROWS", 2)
    # Longer probes overlap in the server's batch, where its one global generator makes the seed unreproducible;
    # 16-token ones could each finish before the next arrives and so reproduce by chance.
    monkeypatch.setattr(endpoint, "PROBE_TOKENS", 64)
    out = tmp_path / "data"
    first = Server(folder, tmp_path / "serve1.log")
    cfg = make_cfg(tmp_path, first.url, first.model, n_train=8, num_samples=2, temperature=1.0, max_new_tokens=24)

    def kill_at_first_part():
        deadline = time.monotonic() + 300
        while not parts(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        first.kill()

    killer = threading.Thread(target=kill_at_first_part)
    killer.start()
    try:
        with pytest.raises(UserError) as err:
            generate_teacher_data(teacher, tokenizer, cfg, out, teacher_id=TEACHER_ID)
    finally:
        killer.join()
        first.kill()
    message = str(err.value)
    assert message.startswith(f"the server at {first.url} stopped answering") and "\n" not in message
    assert "rerun `specdistill data`" in message
    saved, _ = endpoint.load_responses(next(out.glob("teacher-responses-*")))
    assert 0 < saved.num_rows < 16 and not list(out.glob("teacher-*/.complete"))

    second = Server(folder, tmp_path / "serve2.log")
    try:
        moved = dataclasses.replace(cfg, endpoint=dataclasses.replace(cfg.endpoint, url=second.url))  # not in the key
        data = generate_teacher_data(teacher, tokenizer, moved, out, teacher_id=TEACHER_ID)
    finally:
        second.kill()
    ds = load_teacher_data(data.train)
    assert sorted(ds["id"]) == sorted(f"p{i}#{s}" for i in range(8) for s in range(2))  # each row exactly once
    for row, ids in zip(saved["row"].to_pylist(), saved["ids"].to_pylist()):
        assert ds[row]["input_ids"][ds[row]["prompt_len"] :] == ids  # kept, not asked again
    generator = json.loads((data.train / ".complete").read_text())["generator"]
    assert any(note.startswith("seed: two requests with the same seed") for note in generator["not_honoured"])


# ----------------------------------------------------------------------------------------------------------------
# Without a server: the store, the config, the key


def test_a_damaged_part_is_named_removed_and_its_rows_asked_again(tmp_path):
    plan = endpoint.Plan(model="m", dialect="text")
    for rows in ([0, 1], [2]):
        writer = endpoint._PartWriter(tmp_path, 0, plan)
        for row in rows:
            writer.add(endpoint.Response(row, [row, 7], "x", "length", 2, "server", True))
        writer.flush()
    first, second = sorted(tmp_path.glob("part-*.parquet"))
    table, plans = endpoint.load_responses(tmp_path)
    assert (
        table["row"].to_pylist() == [0, 1, 2]
        and table["ids"].to_pylist()[2] == [2, 7]
        and plans == [dataclasses.asdict(plan)]
    )
    second.write_bytes(second.read_bytes()[:-9])  # truncated: a copy cut short, a disk that lost its tail
    said = []
    table, _ = endpoint.load_responses(tmp_path, log=said.append)
    assert table["row"].to_pylist() == [0, 1] and not second.exists() and first.exists()
    assert len(said) == 1 and said[0].startswith(f"{second} is damaged (") and "Parquet magic bytes" in said[0]
    assert said[0].endswith("; its responses will be asked again")


def test_an_api_key_is_named_by_its_variable_and_never_given(tmp_path, monkeypatch):
    from specdistill.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="names an environment variable .* never the key itself"):
        load_config(None, ["data.endpoint.api_key_env=sk-live-1234"])
    cfg = make_cfg(tmp_path, dead_url(), "m", api_key_env="SPECDISTILL_TEST_KEY")
    monkeypatch.delenv("SPECDISTILL_TEST_KEY", raising=False)
    with pytest.raises(UserError, match=r"\$SPECDISTILL_TEST_KEY, which is not set"):
        endpoint.fetch_responses(cfg.endpoint, [], tmp_path, None, endpoint.Sampling(8, 0.0, 0, 1.0), [1])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("data.generator=endpoint", "generator=endpoint needs endpoint.url"),
        ("data.endpoint.url=localhost:8000", "url must start with http:// or https://"),
        ("data.endpoint.max_concurrency=0", "max_concurrency must be >= 1"),
        ("data.endpoint.retries=-1", "retries must be >= 0"),
        ("data.endpoint.modle=x", "unknown key data.endpoint.'modle'. Did you mean 'model'?"),
    ],
)
def test_the_endpoint_section_is_checked(override, match):
    from specdistill.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_config_show_docs_lists_the_endpoint_keys(capsys):
    from specdistill.cli import main

    assert main(["config", "show", "--docs", str(Path(__file__).parent.parent / "configs" / "smoke.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = {line.split(":")[0] for line in lines}
    assert {f"data.endpoint.{k}" for k in EndpointConfig.__dataclass_fields__} | {"data.generator"} <= keys
    assert all(line.split(": ", 1)[1] for line in lines)  # every key documented


def test_runs_from_before_the_endpoint_keys_keep_their_fingerprint_and_resume():
    from specdistill.config import load_config, to_dict
    from specdistill.pipeline import config_drift, training_fingerprint

    cfg = load_config(None)
    saved = to_dict(cfg)
    del saved["data"]["generator"], saved["data"]["endpoint"]  # a checkpoint written before they existed
    assert config_drift(saved, to_dict(cfg)) == []
    served = ["data.generator=endpoint", "data.endpoint.model=m"]
    here = load_config(None, [*served, "data.endpoint.url=http://a:1/v1", "data.endpoint.max_concurrency=8"])
    there = load_config(None, [*served, "data.endpoint.url=http://b:2/v1", "data.endpoint.retries=9"])
    assert training_fingerprint(here) == training_fingerprint(there) != training_fingerprint(cfg)


def test_answers_are_read_as_vllm_and_sglang_give_them(target):
    """The `token-ids` form (vLLM, SGLang), which the CPU server here does not speak: the server's ids are kept as
    they are (its EOS included), cut after the first of our stop tokens, and an id outside the vocabulary, or a
    prompt the server counted otherwise, is refused."""
    _, _, tokenizer = target
    cfg = EndpointConfig(url="http://127.0.0.1:1/v1", model="m")
    job = endpoint._Job(cfg, tokenizer, endpoint.Sampling(8, 0.7, 0, 1.0), [129], Path("."), 0)
    plan = endpoint.Plan(model="m", dialect="token-ids", token_ids=True)
    req = endpoint.Request(3, [128, 65, 66], seed=7)

    def answer(ids, finish="stop", **usage):
        choice = {"text": tokenizer.decode(ids, skip_special_tokens=True), "finish_reason": finish, "token_ids": ids}
        return {"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), **usage}}

    got = job.response(plan, req, answer([72, 105, 129]))
    assert (got.ids, got.source, got.counts_agree, got.server_tokens) == ([72, 105, 129], "server", True, 3)
    assert job.response(plan, req, answer([72, 129, 105, 129])).ids == [72, 129]  # a server that stopped late
    assert job.response(plan, req, answer(list(range(65, 75)), "length")).ids == list(range(65, 73))  # max 8
    with pytest.raises(UserError, match="token id 500, outside the target's vocabulary of 130"):
        job.response(plan, req, answer([72, 500]))
    with pytest.raises(UserError, match="read row 3's prompt as 4 tokens where the target's chat template gives 3"):
        job.response(plan, req, answer([72], prompt_tokens=4))
    text = endpoint.Plan(model="m", dialect="text")  # a text-only answer: re-tokenized, its stop token put back
    got = job.response(text, req, {"choices": [{"text": "Hi", "finish_reason": "stop"}]})
    assert (got.ids, got.source, got.server_tokens) == ([72, 105, 129], "retokenized", -1)
