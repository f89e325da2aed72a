"""Teacher responses from an OpenAI-compatible server (`data.generator: endpoint`): vLLM, SGLang, TGI, llama.cpp,
`transformers serve`. distill/data.py decides which rows to ask for and scores them; this module asks and stores.

    fetch = Fetcher(cfg.data.endpoint, tokenizer, sampling, stop_ids)
    responses = fetch(store, wanted_rows, request_of_row, desc="teacher")   # columns row, ids, ... (STORED)

Same prompts, same template. Every prompt is rendered by our tokenizer's chat template (the one training and eval
use) and sent to `/v1/completions`, which applies no template, never to `/v1/chat/completions`, where the server
would apply its own. One probe, before any row is asked for, picks the first request form the server takes
(`DIALECTS`):

- `token-ids` (vLLM, SGLang, llama.cpp): the prompt travels as our token ids, so it cannot be tokenized another way;
  `return_token_ids` brings the response's ids back (vLLM, SGLang), `top_k`, `stop_token_ids` and `seed` are fields;
- `text+generation_config` (`transformers serve`, which takes a text prompt only and samples only when its
  `generation_config` field says so): the prompt travels as the template's text, sampling and stop ids in that field;
- `text` (TGI and the rest): the OpenAI fields only.

With a text prompt the server's count of prompt tokens (`usage.prompt_tokens`) must equal ours, which catches a
server that tokenizes the text differently (a second BOS); a response without ids is re-tokenized by our tokenizer
and refused unless its text round-trips. Whatever the server's stop set, a response is cut after the first of our
stop tokens (a causal prefix is what a server stopping there returns). Every row is its own request (n=1) with its
own seed, so a sample never depends on which others shared its request; prefix caching (vLLM, SGLang) shares the
prompt's prefill. What the server cannot honour (a seed that does not reproduce, top_k with no field for it, no
token ids) is the plan's `notes`: printed once and kept with every row written under it.

Faults: `max_concurrency` requests in flight (a pool of workers on one httpx.AsyncClient), retries with exponential
backoff on timeouts, lost connections, 429 and 5xx; a refused connection at the start, a model the server does not
list, any other 4xx, or a server that stays down after the retries is one UserError naming the URL and the fix.
Responses are buffered and written to the store as parquet parts (atomic, page checksums) every `FLUSH_ROWS` rows or
`FLUSH_SECONDS` (checked as responses arrive), and on any error: a dead server loses only the requests in flight, a
killed run (SIGKILL) also the responses buffered since the last part (at most `FLUSH_ROWS`); the next run asks for
every missing row again, and rows are keyed by index, so none is written twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from distill.config import DataConfig, EndpointConfig
from specdec_runtime.atomic import write_bytes
from specdec_runtime.errors import UserError

DIALECTS = ("token-ids", "text+generation_config", "text")
STORE_FORMAT = 1  # bump when the stored columns or the request scheme change, so old responses are not reused
FLUSH_ROWS = 256  # responses per stored part, at most ...
FLUSH_SECONDS = 5.0  # ... and at most this old: what a killed run can lose (the requests are asked again)
BACKOFF_S, BACKOFF_MAX_S = 0.5, 30.0
PROBE_TOKENS = 16  # response length of the probe requests (the seed check compares them)
RETRIED = {408, 429, 500, 502, 503, 504}  # answers worth asking again; any other 4xx is the request's fault
PART_PREFIX = "part-"
META_KEY = b"specdistill"
# Columns of a stored part that the data stage reads back (each part also keeps the server's `text`, for inspection).
STORED = {
    "row": pa.int64(),
    "ids": pa.list_(pa.int32()),
    "finish_reason": pa.string(),
    "server_tokens": pa.int32(),
    "source": pa.string(),
    "counts_agree": pa.bool_(),
}


@dataclass(frozen=True)
class Sampling:
    """The sampling settings of data: (temperature 0 = greedy; top_k 0 = off)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class Request:
    row: int
    """Index of the (prompt, sample) row in its split: the key under which the response is stored."""
    prompt_ids: list[int]
    seed: int


@dataclass
class Response:
    row: int
    ids: list[int]
    """Response token ids, the stop token included when one ended it."""
    text: str
    finish_reason: str
    server_tokens: int
    """usage.completion_tokens as the server counted it; -1 when it did not say."""
    source: str
    """`server` (the server's own ids) or `retokenized` (its text, encoded by our tokenizer)."""
    counts_agree: bool
    """Our token count equals the server's (or it gave none): false for a lossy text, or a non-canonical one."""


@dataclass
class Plan:
    """How this server is asked (the probe's result) and what of the settings it cannot honour."""

    model: str
    dialect: str
    token_ids: bool = False
    """Whether the server returns the response's token ids."""
    notes: list[str] = field(default_factory=list)


class _Rejected(Exception):
    """A 4xx answer that asking again will not change."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


class _Down(Exception):
    """No usable answer after every retry."""


# ----------------------------------------------------------------------------------------------------------------
# Entry points


@dataclass
class Fetcher:
    """Brings wanted rows into a store, asking the server only for those not stored yet. The probe's plan is kept
    for the next store (the next split), so the server is probed, and what it cannot honour said, once per run."""

    cfg: EndpointConfig
    tokenizer: object
    sampling: Sampling
    stop_ids: list[int]
    rank: int = 0
    world_size: int = 1
    plan: Plan | None = None

    def __call__(self, store: Path, wanted: list[int], request: Callable[[int], Request], desc: str) -> pa.Table:
        """The stored responses (`load_responses`) once every row of `wanted` is among them; `request(row)` is the
        request of a row still missing."""
        responses, _ = load_responses(store)
        missing = np.setdiff1d(np.asarray(wanted, dtype=np.int64), responses["row"].to_numpy())
        if len(missing):
            job = dict(rank=self.rank, world_size=self.world_size, desc=f"{desc} <- {self.cfg.model}", plan=self.plan)
            requests = [request(int(row)) for row in missing]
            self.plan = fetch_responses(self.cfg, requests, store, self.tokenizer, self.sampling, self.stop_ids, **job)
            responses, _ = load_responses(store)
        lost = np.setdiff1d(np.asarray(wanted, dtype=np.int64), responses["row"].to_numpy())
        if len(lost):
            raise RuntimeError(f"{store}: {len(lost)} responses missing after the fetch, e.g. row {lost[0]}")
        return responses


def response_store(out_dir: Path, split: str, records, prompt_ids, cfg: DataConfig, seed: int, stop_ids) -> Path:
    """The folder of a split's stored responses, `<split>-responses-<key>/`, its key a sha256[:12] of what decides
    them: the served model's name, the sampling settings, the prompts and their ids, the seed and stop ids; not the
    URL (the same server may move) nor our target. Kept after the merge, so a new scoring pass (another target dtype,
    teacher_cache switched on) asks the server for nothing."""
    settings = {name: getattr(cfg, name) for name in ("num_samples", "max_new_tokens", "temperature", "top_k", "top_p")}
    key = {
        "format": STORE_FORMAT,
        "split": split,
        "endpoint_model": cfg.endpoint.model,
        "seed": seed,
        "stop_ids": list(stop_ids),
        "settings": settings,
        "prompts": [[r.id, r.category, r.messages, ids] for r, ids in zip(records, prompt_ids)],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(out_dir) / f"{split}-responses-{digest}"


def endpoint_summary(store: Path, model: str) -> dict:
    """A finished split's `generator` record (in its completion marker): the served model, how it was asked, what it
    could not honour, and how many responses were re-tokenized or counted otherwise by the server than by us."""
    responses, plans = load_responses(store)
    return {
        "kind": "endpoint",
        "model": model,
        "dialects": sorted({p["dialect"] for p in plans}),
        "not_honoured": sorted({note for p in plans for note in p["notes"]}),
        "retokenized_rows": int(pc.sum(pc.equal(responses["source"], "retokenized")).as_py() or 0),
        "token_count_mismatch_rows": int(pc.sum(pc.invert(responses["counts_agree"])).as_py() or 0),
    }


def fetch_responses(
    cfg: EndpointConfig,
    requests: list[Request],
    store: Path,
    tokenizer,
    sampling: Sampling,
    stop_ids: list[int],
    *,
    rank: int = 0,
    world_size: int = 1,
    desc: str = "responses",
    plan: Plan | None = None,
) -> Plan:
    """Ask the server for every request's response and store them in `store` as they arrive (module docstring).
    Each of `world_size` processes takes its share of data.endpoint.max_concurrency. `plan`: an earlier call's
    result for the same server (the next split), so the probe and its log line come once."""
    headers = {"Authorization": f"Bearer {_api_key(cfg)}"} if cfg.api_key_env else {}
    concurrency = max(1, cfg.max_concurrency // world_size)
    job = _Job(cfg, tokenizer, sampling, stop_ids, Path(store), rank)
    return asyncio.run(job.run(requests, headers, concurrency, desc, plan))


def load_responses(store: Path, *, log=print) -> tuple[pa.Table, list[dict]]:
    """Every stored response, sorted by row and each row once (columns `STORED`), and the distinct plans (as dicts)
    they were fetched under. A part that does not read back whole (truncated, a failed page checksum) is named,
    removed, and its rows count as never fetched."""
    tables, plans = [], []
    for path in sorted(Path(store).glob(f"{PART_PREFIX}*.parquet")):
        try:
            table = pq.read_table(path, columns=list(STORED), page_checksum_verification=True)
            plan = json.loads(table.schema.metadata[META_KEY])
        except Exception as e:  # damage: said, removed, asked again
            log(f"{path} is damaged ({str(e).splitlines()[0]}); its responses will be asked again")
            path.unlink(missing_ok=True)  # another process reading the store may have removed it first
            continue
        tables.append(table.replace_schema_metadata(None))
        if plan not in plans:
            plans.append(plan)
    if not tables:
        return pa.schema(STORED.items()).empty_table(), plans
    table = pa.concat_tables(tables).sort_by("row")
    rows = table["row"].to_numpy()
    return table.filter(np.r_[True, rows[1:] != rows[:-1]]), plans  # a row is written once; a repeat is dropped


# ----------------------------------------------------------------------------------------------------------------
# One fetch: probe, then a pool of workers


@dataclass
class _Job:
    cfg: EndpointConfig
    tokenizer: object
    sampling: Sampling
    stop_ids: list[int]
    store: Path
    rank: int

    @property
    def url(self) -> str:
        return self.cfg.url.rstrip("/")

    async def run(self, requests: list[Request], headers: dict, concurrency: int, desc: str, plan: Plan | None):
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        url = self.url
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=self.cfg.timeout_s, limits=limits) as c:
            if plan is None:
                plan = await self.probe(c, requests[0])
                if self.rank == 0:
                    print(_describe(plan, url), flush=True)
            writer = _PartWriter(self.store, self.rank, plan)
            todo = list(reversed(requests))
            bar = tqdm(total=len(requests), desc=desc, unit="seq", disable=self.rank != 0)
            start, tokens = time.perf_counter(), 0

            async def worker() -> None:
                nonlocal tokens
                while todo:
                    req = todo.pop()
                    data = await self.post(c, self.body(plan, req, self.sampling.max_new_tokens))
                    response = self.response(plan, req, data)
                    writer.add(response)
                    tokens += len(response.ids)
                    bar.update(1)
                    bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s", refresh=False)

            workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(requests)))]
            try:
                await _first_error(workers)
            except (_Down, _Rejected) as e:
                writer.flush()
                saved = f"the {writer.written} responses received are saved in {self.store}"
                if isinstance(e, _Rejected):  # e.g. a prompt longer than the server's --max-model-len
                    raise UserError(f"{self.refused(e)}; {saved}") from None
                raise UserError(
                    f"the server at {url} stopped answering ({e}) after {self.cfg.retries} retries; {saved}: "
                    "restart the server and rerun `specdistill data` to ask for the rest"
                ) from None
            finally:
                writer.flush()
                bar.close()
        return plan

    # ---- the probe

    async def probe(self, client: httpx.AsyncClient, first: Request) -> Plan:
        """Check the model name, pick the dialect with a short request for `first`, and test the seed."""
        await self.check_model(client)
        refusals = []
        for dialect in DIALECTS:
            plan = Plan(model=self.cfg.model, dialect=dialect)
            try:
                data = await self.post(client, self.body(plan, first, PROBE_TOKENS), retries=False)
            except _Rejected as e:
                if e.status not in (400, 422):
                    raise self.refused(e) from None
                refusals.append(f"{dialect}: {e}")
                continue
            plan.token_ids = isinstance(_choice(data, self.url).get("token_ids"), list)
            self.response(plan, first, data)  # the prompt-length and round-trip checks, before any row is kept
            plan.notes = _dialect_notes(plan, self.sampling) + await self.seed_notes(client, plan, first)
            return plan
        raise UserError(
            f"the server at {self.url} refused every form of /v1/completions request ({'; '.join(refusals)}); "
            "data.generator=endpoint needs the legacy completions API (vLLM, SGLang, TGI, llama.cpp and "
            "transformers serve have it)"
        )

    async def check_model(self, client: httpx.AsyncClient) -> None:
        """Refuse a model name the server does not list (servers without /models are checked by the probe)."""
        try:
            r = await client.get("/models")
        except httpx.TransportError as e:
            raise UserError(
                f"cannot connect to the server at {self.url} ({_cause(e)}): start it (e.g. `vllm serve "
                "MODEL`) or fix data.endpoint.url"
            ) from None
        if r.status_code in (401, 403):
            raise self.refused(_Rejected(r.status_code, _detail(r)))
        if r.status_code != 200:
            return
        try:
            served = [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            return
        if served and self.cfg.model not in served:
            raise UserError(
                f"the server at {self.url} does not serve model {self.cfg.model!r} (it serves "
                f"{', '.join(map(repr, served))}); set data.endpoint.model to one of these"
            )

    async def seed_notes(self, client: httpx.AsyncClient, plan: Plan, first: Request) -> list[str]:
        """Three concurrent probes of `first`, two with its seed and one with another: whether the seed reproduces a
        response and whether the server samples at all (greedy decoding at temperature > 0 is a silent bug)."""
        if self.sampling.temperature == 0:
            return []
        other = Request(first.row, first.prompt_ids, first.seed ^ 1)
        bodies = [self.body(plan, req, PROBE_TOKENS) for req in (first, first, other)]
        answers = await asyncio.gather(*(self.post(client, body) for body in bodies))
        a, b, c = (_choice(data, self.url)["text"] for data in answers)
        notes = []
        if a != b:
            notes.append("seed: two requests with the same seed got different responses, so rows are not reproducible")
        elif a == c and len(a) >= PROBE_TOKENS // 2:
            notes.append(
                "sampling: requests with different seeds got the same response; the server may decode greedily "
                "(transformers serve --continuous-batching samples only when the model's generation_config.json "
                "sets do_sample: true)"
            )
        return notes

    # ---- one request

    def body(self, plan: Plan, req: Request, max_tokens: int) -> dict:
        s = self.sampling
        body = {"model": plan.model, "max_tokens": max_tokens, "temperature": s.temperature, "top_p": s.top_p}
        body["seed"] = req.seed
        match plan.dialect:
            case "token-ids":
                body |= {"prompt": req.prompt_ids, "top_k": s.top_k or -1, "stop_token_ids": self.stop_ids}
                # Explicit: vLLM takes what a request leaves out from the model's generation_config (a penalty)
                body |= {"min_p": 0.0, "repetition_penalty": 1.0}
                body["return_token_ids"] = True  # vLLM, SGLang; others ignore it and answer with text
            case "text+generation_config":
                body["prompt"] = prompt_text(self.tokenizer, req.prompt_ids)
                # transformers serve samples only when the generation config says so, whatever `temperature` says
                generation = {"do_sample": s.temperature > 0, "temperature": s.temperature or 1.0, "top_p": s.top_p}
                generation |= {"top_k": s.top_k, "max_new_tokens": max_tokens, "eos_token_id": self.stop_ids}
                body["generation_config"] = json.dumps(generation)
            case "text":
                body["prompt"] = prompt_text(self.tokenizer, req.prompt_ids)
        return body

    async def post(self, client: httpx.AsyncClient, body: dict, *, retries: bool = True) -> dict:
        """POST /completions; retried (with backoff) on timeouts, lost connections, 429 and 5xx when `retries`."""
        attempts = self.cfg.retries + 1 if retries else 1
        for attempt in range(attempts):
            try:
                r = await client.post("/completions", json=body)
            except httpx.TransportError as e:
                if not retries:
                    raise UserError(f"cannot reach {self.url}/completions ({_cause(e)}); is the server up?") from None
                cause = _cause(e)
            else:
                if r.status_code < 400:
                    return _json(r)
                if r.status_code not in RETRIED:
                    raise _Rejected(r.status_code, _detail(r))
                cause = f"HTTP {r.status_code}: {_detail(r)}"
            if attempt + 1 < attempts:
                await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.5))
        raise _Down(cause)

    def response(self, plan: Plan, req: Request, data: dict) -> Response:
        """The stored row of one answer: its ids (the server's, or its text re-tokenized), cut at our stop set."""
        choice, usage = _choice(data, self.url), data.get("usage") or {}
        if usage.get("prompt_tokens") not in (None, len(req.prompt_ids)):
            raise UserError(
                f"the server at {self.url} read row {req.row}'s prompt as {usage['prompt_tokens']} tokens where "
                f"the target's chat template gives {len(req.prompt_ids)}: it tokenizes the text differently (e.g. "
                "adds a BOS of its own); use a server that takes token-id prompts (vLLM, SGLang, llama.cpp)"
            )
        text, finish = choice["text"], choice.get("finish_reason") or "length"
        if finish not in ("stop", "length"):  # SGLang's "abort", a content filter: not a response of the model
            raise UserError(f"the server at {self.url} ended row {req.row} with finish_reason={finish!r}")
        if plan.token_ids and isinstance(choice.get("token_ids"), list):
            ids, source = [int(t) for t in choice["token_ids"]], "server"
            if max(ids, default=0) >= len(self.tokenizer):
                raise UserError(
                    f"the server at {self.url} answered row {req.row} with token id {max(ids)}, outside the "
                    f"target's vocabulary of {len(self.tokenizer)}: it serves another model than target.model"
                )
        else:
            ids, source = self.retokenize(text, req.row), "retokenized"
        if finish == "stop" and not set(ids) & set(self.stop_ids):  # text leaves out the stop token it matched
            matched = choice.get("stop_reason", choice.get("matched_stop"))
            ids.append(matched if matched in self.stop_ids else self.stop_ids[0])
        counted = usage.get("completion_tokens")
        server_tokens = counted if isinstance(counted, int) else -1
        agree = server_tokens < 0 or server_tokens == len(ids)  # a lossy text (bytes decoded to U+FFFD) disagrees
        stop = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        ids = ids[: min(stop + 1, self.sampling.max_new_tokens)]
        return Response(req.row, ids, text, finish, server_tokens, source, agree)

    def retokenize(self, text: str, row: int) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.tokenizer.decode(ids, clean_up_tokenization_spaces=False) != text:
            raise UserError(
                f"the server at {self.url} returns text only, and row {row}'s text does not round-trip through "
                "the target's tokenizer, so its token ids cannot be recovered; use a server that returns token ids "
                "(vLLM, SGLang)"
            )
        return ids

    def refused(self, e: _Rejected) -> UserError:
        if e.status in (401, 403) and self.cfg.api_key_env:
            hint = f"check the key in ${self.cfg.api_key_env}"
        elif e.status in (401, 403):
            hint = "it wants a key: set data.endpoint.api_key_env to the environment variable that holds it"
        elif e.status == 404:
            hint = "check data.endpoint.url (the server's /v1 base URL) and data.endpoint.model"
        else:
            hint = "see the server's message and its log"
        return UserError(f"the server at {self.url} refused the request for {self.cfg.model!r} ({e}); {hint}")


# ----------------------------------------------------------------------------------------------------------------
# Leaf helpers


def prompt_text(tokenizer, ids: list[int]) -> str:
    """The text sent for prompt `ids` to a server that takes text: the text of the ids, or, when the server's
    tokenizer adds a BOS of its own (HF servers tokenize with special tokens), the text after ours."""
    text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if ids[:1] == [tokenizer.bos_token_id] and tokenizer(text)["input_ids"] != ids:
        rest = tokenizer.decode(ids[1:], clean_up_tokenization_spaces=False)
        if tokenizer(rest)["input_ids"] == ids:
            return rest
    return text


def _dialect_notes(plan: Plan, sampling: Sampling) -> list[str]:
    notes = []
    if plan.dialect != "token-ids":
        notes.append("prompt: sent as the chat template's text (the server takes no token ids); its length checked")
    if not plan.token_ids:
        notes.append("token ids: the server returns text only; responses are re-tokenized by the target's tokenizer")
    if plan.dialect == "text":
        notes.append("stop_token_ids: no field for them; the server stops at its own end-of-sequence tokens")
        if sampling.top_k:
            notes.append(f"top_k={sampling.top_k}: no field for it; the server samples without top-k")
    if plan.dialect == "text+generation_config":
        notes.append("top_k, stop ids, sampling on: sent in transformers' generation_config field (transformers serve)")
    return notes


def _describe(plan: Plan, url: str) -> str:
    how = "token-id prompts" if plan.dialect == "token-ids" else f"text prompts ({plan.dialect})"
    ids = "token ids returned" if plan.token_ids else "responses re-tokenized"
    notes = "; ".join(plan.notes) if plan.notes else "every setting honoured"
    return f"endpoint {url} ({plan.model!r}): {how}, {ids}; {notes}"


def _api_key(cfg: EndpointConfig) -> str:
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise UserError(
            f"data.endpoint.api_key_env names ${cfg.api_key_env}, which is not set; export the server's API key in it"
        )
    return key


def _choice(data: dict, url) -> dict:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0].get("text"), str):
        raise UserError(f"the server at {url} answered /v1/completions without one choice with text: {str(data)[:200]}")
    return choices[0]


def _json(r: httpx.Response) -> dict:
    try:
        return r.json()
    except ValueError:
        raise UserError(f"{r.request.url} answered with something other than JSON: {r.text[:200]!r}") from None


def _detail(r: httpx.Response) -> str:
    """The server's own words: FastAPI's `detail`, vLLM's `message`, an `error` string or object, else the body."""
    try:
        data = r.json()
    except ValueError:
        return r.text[:300]
    if isinstance(data, dict):
        err = data.get("error")
        for value in (data.get("detail"), data.get("message"), err.get("message") if isinstance(err, dict) else err):
            if value:
                return str(value)[:300]
    return str(data)[:300]


def _cause(e: httpx.TransportError) -> str:
    """What went wrong, in words: a refused connection shows only deep in the chain anyio wraps it in."""
    if isinstance(e, httpx.TimeoutException):
        return "no answer in time"
    chain, inner = [], e
    while inner is not None and len(chain) < 8:
        chain.append(inner)
        inner = inner.__cause__ or inner.__context__
    if any(isinstance(x, ConnectionRefusedError) for x in chain):
        return "connection refused"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def _first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; on the first error cancel the others and raise it."""
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()


class _PartWriter:
    """Buffers responses and writes them to the store as parquet parts, atomically."""

    def __init__(self, store: Path, rank: int, plan: Plan):
        self.store, self.rank, self.meta = store, rank, json.dumps(asdict(plan)).encode()
        self.buffer: list[Response] = []
        self.written, self.since = 0, time.monotonic()
        for stale in store.glob(f".{PART_PREFIX}r{rank}-*.tmp"):  # a write of this rank's, cut by a kill
            stale.unlink(missing_ok=True)

    def add(self, response: Response) -> None:
        self.buffer.append(response)
        if len(self.buffer) >= FLUSH_ROWS or time.monotonic() - self.since >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.since = time.monotonic()
        if not self.buffer:
            return
        cols = {name: [getattr(r, name) for r in self.buffer] for name in Response.__dataclass_fields__}
        table = pa.table({k: pa.array(v, STORED.get(k, pa.string())) for k, v in cols.items()})
        sink = pa.BufferOutputStream()
        pq.write_table(table.replace_schema_metadata({META_KEY: self.meta}), sink, write_page_checksum=True)
        name = f"{PART_PREFIX}r{self.rank}-{time.time_ns()}.parquet"
        write_bytes(self.store / name, sink.getvalue().to_pybytes())
        self.written += len(self.buffer)
        self.buffer = []
