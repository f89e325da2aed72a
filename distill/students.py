"""Student (draft) construction from an already-loaded teacher (a Llama-family HF causal LM).

    student = build_student(teacher, DraftConfig(init="truncate", num_layers=4))
    pretrained = DraftConfig(init="pretrained", pretrained="HuggingFaceTB/SmolLM2-135M", lora=True)
    student = build_student(teacher, pretrained, teacher_tokenizer=tokenizer, load_options={"dtype": "float32"})
    print(describe_student(student, teacher))
    export_me = merge_student(student)  # LoRA merged into plain weights; other students come back as they are

Every student is a new model that shares no tensor with the teacher, on the teacher's device and in its dtype (a
pretrained one in the dtype `specdec_runtime.loading.load_model` gives it under `load_options`).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec_runtime.errors import UserError
from specdec_runtime.loading import check_vocab_compatible, load_model
from specdec_runtime.lookup import LOOKUP_KINDS, lookup_draft

# Config attributes holding one entry per decoder layer; truncation keeps the kept layers' entries.
PER_LAYER_CONFIG_LISTS = ("layer_types", "mlp_layer_types", "no_rope_layers")
LLAMA_LINEAR_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# speculators' EAGLE-3 head variants a training can switch on (DraftConfig keys of the same names; off: the engines'
# original layout). specdec_runtime.eagle3.VARIANTS also holds the sliding window, which only a loaded head has.
HEAD_VARIANTS = ("norm_before_residual", "norm_before_fc", "norm_output")


@dataclass
class DraftConfig:
    init: Literal["truncate", "config", "pretrained", "eagle3", "ngram", "suffix"] = "truncate"
    """How the draft starts: truncate the target's layers, a smaller random config, a pretrained small model, an
    EAGLE-3 head (one layer fed with the target's hidden states, reduced vocabulary; distill/eagle3.py), or a
    zero-training draft every serving engine offers, evaluated next to the distilled ones and never trained: ngram
    (prompt lookup) or suffix (suffix decoding; specdec_runtime/lookup.py)."""
    layers: list[int] | None = None
    """truncate: the target layer indices to keep (strictly increasing); None = `num_layers` evenly spaced."""
    num_layers: int = 4
    """truncate: how many evenly spaced target layers to keep (first and last included); config: layer count."""
    hidden_size: int | None = None
    """config: hidden size (0 or None = the target's)."""
    num_attention_heads: int | None = None
    """config: attention heads (0 or None = the target's)."""
    num_key_value_heads: int | None = None
    """config: key/value heads for grouped-query attention (0 or None = the target's)."""
    intermediate_size: int | None = None
    """config: MLP intermediate size (0 or None = the target's)."""
    pretrained: str | None = None
    """pretrained: the draft model spec (HF id, local folder, .gguf, embedded:...); must share the target's vocab."""
    lora: bool = False
    """Train LoRA adapters only (peft) on a truncate or pretrained draft; merged into the weights on export."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch input during training."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LINEAR_MODULES))
    """Names of the linear modules that get adapters (Llama-family names by default)."""
    aux_layers: list[int] | None = None
    """eagle3: the 3 target layers whose inputs feed the head (HF output_hidden_states indices in [1, L - 1],
    ascending); None = [2, L // 2, L - 3], the default vLLM and SGLang assume."""
    draft_vocab_size: int = 8192
    """eagle3: tokens of the draft vocabulary, the most frequent ones of the teacher's responses (clipped to the
    target's vocabulary); counted once per candidate and stored with it, never rebuilt on resume."""
    ttt_depth: int = 5
    """eagle3: training-time-test steps unrolled per position (EAGLE and SpecForge use 7, speculators 3)."""
    ttt_decay: float = 0.8
    """eagle3: weight of unrolled step j's loss is ttt_decay ** j (EAGLE-3: 0.8)."""
    pack_sequences: bool = True
    """eagle3: train on each micro-batch's sequences concatenated into one row (attention kept within each sequence,
    positions counted from 0 in each; as speculators trains) instead of each padded to the longest: the step then
    computes on real tokens only. The attention over the row grows with its length squared, so when every sequence
    is near train.max_seq_len packing saves nothing and false is cheaper (docs/benchmarks.md)."""
    skip_untrained_rows: bool = True
    """eagle3: each unrolled training-time-test step computes only the rows a loss reads (step 0 every row's key and
    value): the same loss and gradients as every row (tests/test_eagle3.py), most of the compute saved when only
    response tokens are trained (`distill.loss_on_prompt: false`), little with the default, which trains nearly every
    row. false computes every row (to measure what skipping buys, docs/benchmarks.md)."""
    freeze_lm_head: bool = False
    """eagle3: keep lm_head at the target's rows of the draft vocabulary (as speculators does); false trains it
    (as EAGLE does)."""
    init_std: float = 0.0
    """eagle3: start fc and the layer's linears from normal(0, init_std), as HF models and speculators do (0.02);
    0 = torch's default for a Linear (Kaiming uniform, std 1 / sqrt(3 fan_in): 0.014 to 0.024 on SmolLM2's sizes).
    Muon moves weights by a fixed small step (train.optimizer), so where they start matters more there."""
    norm_from_target: bool = True
    """eagle3: start the head's final norm at the target's final norm weights (lm_head starts at the target's rows);
    false starts it at ones, as speculators does."""
    norm_before_residual: bool = False
    """eagle3: the layer's residual taken after hidden_norm, not before it (a variant of speculators' trainer and
    Eagle 3.1, which vLLM reads from the head's config.json); false is the engines' original EAGLE-3 layout."""
    norm_before_fc: bool = False
    """eagle3: an RMSNorm over the three concatenated aux states before fc (a variant of speculators' trainer)."""
    norm_output: bool = False
    """eagle3: later draft steps read the layer's normed output instead of its pre-norm one (a variant of
    speculators' trainer). Our runtime computes all three variants; promotion refuses a head with
    norm_before_fc or norm_output, which not every engine computes (docs/eval-and-serving.md)."""
    lookup_knobs: list[str] = field(default_factory=lambda: [""])
    """ngram / suffix: the knob settings the eval sweeps, each one candidate, spelled as on the command line: ngram
    'max=4,min=2' (prompt_lookup_max / _min), suffix 'depth=24,factor=1.0,prob=0.1,cached=1000' (tree depth,
    max_spec_factor, min_token_prob, max_cached_requests); '' = the kind's defaults (those values)."""

    def __post_init__(self) -> None:
        if self.init not in ("truncate", "config", "pretrained", "eagle3", *LOOKUP_KINDS):
            raise ValueError(
                f"init must be one of truncate, config, pretrained, eagle3, ngram, suffix; got {self.init!r}"
            )
        self._check_lookup()
        if self.layers is not None:
            if self.init != "truncate":
                raise ValueError(f"layers is only used by init=truncate, got init={self.init}")
            if not self.layers or self.layers[0] < 0 or any(a >= b for a, b in zip(self.layers, self.layers[1:])):
                raise ValueError(f"layers must be non-empty, >= 0 and strictly increasing, got {self.layers}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        shape = {
            k: getattr(self, k)
            for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
        }
        for name, value in shape.items():
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0 or None = the target's), got {value}")
        if any(shape.values()) and self.init != "config":
            raise ValueError(f"{', '.join(k for k, v in shape.items() if v)} only apply to init=config")
        if (self.init == "pretrained") != bool(self.pretrained):
            raise ValueError("init=pretrained needs pretrained=<model spec>, and pretrained is only used by it")
        if self.lora and self.init == "config":
            raise ValueError("lora needs trained base weights: use init=truncate or init=pretrained")
        if self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError(
                f"need lora_r >= 1, lora_alpha > 0, 0 <= lora_dropout < 1; got r={self.lora_r}, "
                f"alpha={self.lora_alpha}, dropout={self.lora_dropout}"
            )
        if not self.lora_target_modules:
            raise ValueError("lora_target_modules must name at least one module")
        self._check_eagle3()

    @property
    def lookup_specs(self) -> list[str]:
        """ngram / suffix: one `specdec_runtime.lookup.lookup_draft` spec per knob setting ([] for a trained draft)."""
        if self.init not in LOOKUP_KINDS:
            return []
        return [f"{self.init}:{knobs}" if knobs else self.init for knobs in self.lookup_knobs]

    def _check_lookup(self) -> None:
        if self.init not in LOOKUP_KINDS:
            if self.lookup_knobs != [""]:
                raise ValueError(f"lookup_knobs is only used by init=ngram or init=suffix, got init={self.init}")
            return
        if not self.lookup_knobs or len(set(self.lookup_knobs)) != len(self.lookup_knobs):
            raise ValueError(f"lookup_knobs must list distinct knob settings ('' = defaults), got {self.lookup_knobs}")
        for spec in self.lookup_specs:
            try:
                lookup_draft(spec)
            except UserError as e:
                raise ValueError(f"lookup_knobs: {e}") from None

    def _check_eagle3(self) -> None:
        if self.aux_layers is not None:
            if self.init != "eagle3":
                raise ValueError(f"aux_layers is only used by init=eagle3, got init={self.init}")
            if (
                len(self.aux_layers) != 3
                or any(i < 1 for i in self.aux_layers)
                or self.aux_layers != sorted(self.aux_layers)
            ):
                raise ValueError(
                    f"aux_layers must be 3 layer indices >= 1 in ascending order (the serving engines concatenate "
                    f"them in layer order) or None, got {self.aux_layers}"
                )
        if not 0 <= self.init_std < 1:
            raise ValueError(f"init_std must be in [0, 1) (0 = torch's default), got {self.init_std}")
        variants = [k for k in HEAD_VARIANTS if getattr(self, k)]
        if variants and self.init != "eagle3":
            raise ValueError(f"{', '.join(variants)} only apply to init=eagle3, got init={self.init}")
        if self.init == "eagle3" and self.lora:
            raise ValueError("lora does not apply to init=eagle3 (the head is small and trains in full)")
        if self.draft_vocab_size < 1 or self.ttt_depth < 1 or not 0 < self.ttt_decay <= 1:
            raise ValueError(
                f"need draft_vocab_size >= 1, ttt_depth >= 1, 0 < ttt_decay <= 1; got {self.draft_vocab_size}, "
                f"{self.ttt_depth}, {self.ttt_decay}"
            )


# ----------------------------------------------------------------------------------------------------------------
# truncate


def evenly_spaced_layers(num_teacher_layers: int, num_layers: int) -> list[int]:
    """`num_layers` indices spread over the teacher's layers, first and last included ([0] when num_layers is 1)."""
    if not 1 <= num_layers <= num_teacher_layers:
        raise ValueError(f"num_layers must be in [1, {num_teacher_layers}] (the teacher's layers), got {num_layers}")
    if num_layers == 1:
        return [0]
    step = (num_teacher_layers - 1) / (num_layers - 1)  # >= 1, so rounding never repeats an index
    return [math.floor(i * step + 0.5) for i in range(num_layers)]


def truncate_student(teacher: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """A copy of the teacher keeping only decoder `layers` (plus embeddings, final norm and head)."""
    stack = teacher.base_model.layers
    if not layers or any(not 0 <= i < len(stack) for i in layers) or sorted(set(layers)) != list(layers):
        raise ValueError(f"layers must be strictly increasing indices in [0, {len(stack) - 1}], got {layers}")
    # Share one memo so the kept layers and the rest of the copy point to the same copied config; the full stack
    # is never copied.
    memo = {id(stack): nn.ModuleList()}
    student = copy.deepcopy(teacher, memo)
    student.base_model.layers = nn.ModuleList(copy.deepcopy(stack[i], memo) for i in layers)
    config = student.config
    for name in PER_LAYER_CONFIG_LISTS:
        values = getattr(config, name, None)
        if isinstance(values, list) and len(values) == len(stack):
            setattr(config, name, [values[i] for i in layers])
    config.num_hidden_layers = len(layers)
    # Attention modules index the KV cache by their layer_idx, which must follow the new numbering.
    for new_idx, layer in enumerate(student.base_model.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx
    return student


# ----------------------------------------------------------------------------------------------------------------
# config


def config_student(
    teacher: PreTrainedModel,
    num_layers: int,
    hidden_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
) -> PreTrainedModel:
    """A randomly initialised smaller model of the teacher's architecture; unset (None or 0) sizes inherit.

    The input embeddings, the final norm and an untied head are copied from the teacher when the hidden size
    matches, so the student starts in the teacher's token space.
    """
    base = teacher.config
    hidden = hidden_size or base.hidden_size
    heads = num_attention_heads or base.num_attention_heads
    kv_heads = num_key_value_heads or base.num_key_value_heads
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"need hidden_size % num_attention_heads == 0 and num_attention_heads % num_key_value_heads"
            f" == 0, got {hidden}, {heads}, {kv_heads}"
        )
    overrides = {
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate_size or base.intermediate_size,
    }
    if getattr(base, "head_dim", None) and (hidden, heads) != (base.hidden_size, base.num_attention_heads):
        overrides["head_dim"] = hidden // heads  # an inherited head_dim would no longer fit
    spread = evenly_spaced_layers(base.num_hidden_layers, num_layers) if num_layers <= base.num_hidden_layers else []
    for name in PER_LAYER_CONFIG_LISTS:
        values = getattr(base, name, None)
        if isinstance(values, list) and len(values) == base.num_hidden_layers:
            # keep the teacher's pattern when shrinking; let the config rebuild its default when growing
            overrides[name] = [values[i] for i in spread] if spread else None
    config = type(base).from_dict({**base.to_dict(), **overrides})
    student = type(teacher)(config).to(device=teacher.device, dtype=teacher.dtype)
    _copy_if_same_shape(teacher.get_input_embeddings().weight, student.get_input_embeddings().weight)
    _copy_if_same_shape(teacher.base_model.norm.weight, student.base_model.norm.weight)
    head = student.get_output_embeddings().weight
    if head is not student.get_input_embeddings().weight:  # an untied head has its own weights to copy
        _copy_if_same_shape(teacher.get_output_embeddings().weight, head)
    return student


@torch.no_grad()
def _copy_if_same_shape(source: torch.Tensor, dest: torch.Tensor) -> None:
    if source.shape == dest.shape:
        dest.copy_(source)


# ----------------------------------------------------------------------------------------------------------------
# pretrained


def pretrained_student(
    teacher: PreTrainedModel,
    spec: str,
    teacher_tokenizer: PreTrainedTokenizerBase,
    load_options: Mapping[str, object] | None = None,
) -> PreTrainedModel:
    """Load `spec` on the teacher's device (`load_model(spec, **load_options)`: dtype, trust_remote_code,
    allow_pickle) and refuse it unless its vocabulary is the teacher's (`check_vocab_compatible`, the whole vocabulary).

    When only the padded embedding sizes differ (e.g. Qwen2.5 0.5B vs 7B), the student's embeddings are resized to
    the teacher's so the logits line up; the extra rows are never-used ids.
    """
    student, tokenizer = load_model(spec, **{**(load_options or {}), "device": str(teacher.device)})
    check_vocab_compatible(teacher_tokenizer, tokenizer)
    teacher_rows, student_rows = teacher.config.vocab_size, student.config.vocab_size
    if teacher_rows != student_rows:
        if min(teacher_rows, student_rows) < len(tokenizer):
            raise UserError(
                f"draft.pretrained={spec}: embedding rows differ (teacher {teacher_rows}, student {student_rows}) and "
                f"do not cover the {len(tokenizer)} tokens of the tokenizer; pick a draft of the teacher's model family"
            )
        student.resize_token_embeddings(teacher_rows, mean_resizing=False)
    return student.to(teacher.device)  # in the dtype load_model gave it: a bf16 cast would round fp32 weights


# ----------------------------------------------------------------------------------------------------------------
# LoRA


def add_lora(student: PreTrainedModel, r: int, alpha: float, dropout: float, target_modules: list[str]) -> PeftModel:
    """Wrap `student` with peft LoRA adapters; only the adapters train."""
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():  # peft probes a property transformers 5 deprecated; nothing for users to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = get_peft_model(student, config)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable or any("lora_" not in name for name in trainable):
        raise RuntimeError(f"LoRA must train only adapter weights, trainable: {trainable[:5]}")
    return model


def lora_base(model: PeftModel) -> PreTrainedModel:
    """A plain copy of a LoRA student's frozen base: the adapters removed, not merged (`model` keeps training)."""
    return copy.deepcopy(model).unload()


def merge_student(model: PreTrainedModel | PeftModel) -> PreTrainedModel:
    """A plain model with the LoRA adapters merged into its weights (a copy; `model` keeps training).
    A model without adapters is returned as it is."""
    if not isinstance(model, PeftModel):
        return model
    return copy.deepcopy(model).merge_and_unload()


# ----------------------------------------------------------------------------------------------------------------
# the student's head, applied in the loss


def student_hidden(student: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T, D) final (normed) hidden states, through the prepared model so DDP / DeepSpeed hooks run; the head is
    applied to one position only (logits_to_keep=1)."""
    out = student(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    return out.hidden_states[-1]


def chunked_head(model: nn.Module) -> torch.Tensor | None:
    """The student's output projection W when its logits are exactly final_hidden @ W.T, else None.

    With it the loss computes the student's logits chunk by chunk (and their gradient in backward), so the full
    (B, T, V) student logits never exist. Checked on a small batch, not assumed: a head with a bias, logit scaling
    or soft-capping (Gemma-2, Cohere), or a model without `logits_to_keep`, keeps the full-logits path.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    ids = torch.arange(8, device=head.weight.device)[None] % model.config.vocab_size  # (1, 8)
    was_training = model.training
    model.eval()  # no dropout: the two forwards must see the same weights and draw no random numbers
    try:
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits
            hidden = student_hidden(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    except (TypeError, ValueError, AttributeError):  # no logits_to_keep / output_hidden_states
        return None
    finally:
        model.train(was_training)
    exact = torch.allclose((hidden @ head.weight.T).float(), full.float(), rtol=1e-4, atol=1e-4)
    return head.weight if exact else None


# ----------------------------------------------------------------------------------------------------------------
# describe


def flops_per_token(model: nn.Module) -> int:
    """2 x the weights one token multiplies through: every parameter except the input embedding table (a lookup),
    with a tied head counted as the head's matmul. Ignores the context-length term of attention (4 x layers x T x
    hidden per token) and norms' elementwise work; LoRA adapters count (they run unmerged while training)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    matmul = sum(p.numel() for p in model.parameters() if p is not embedding)
    if head is embedding:
        matmul += head.numel()
    return 2 * matmul


def student_stats(student: nn.Module, teacher: nn.Module) -> dict[str, float]:
    """Parameter counts and per-token FLOPs of the student, and its FLOP ratio to the teacher."""
    flops, teacher_flops = flops_per_token(student), flops_per_token(teacher)
    return {
        "params": sum(p.numel() for p in student.parameters()),
        "trainable_params": sum(p.numel() for p in student.parameters() if p.requires_grad),
        "teacher_params": sum(p.numel() for p in teacher.parameters()),
        "flops_per_token": flops,
        "teacher_flops_per_token": teacher_flops,
        "flop_ratio": flops / teacher_flops,
    }


def describe_student(student: nn.Module, teacher: nn.Module) -> str:
    """One line: sizes, parameter counts and the FLOP ratio to the teacher (formula in `flops_per_token`)."""
    s = student_stats(student, teacher)
    cfg, tcfg = student.config, teacher.config
    return (
        f"student: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {s['params'] / 1e6:.2f}M params "
        f"({s['trainable_params'] / 1e6:.2f}M trainable), {s['flops_per_token'] / 1e6:.1f} MFLOP/token | teacher: "
        f"{tcfg.num_hidden_layers} layers, {s['teacher_params'] / 1e6:.2f}M params, "
        f"{s['teacher_flops_per_token'] / 1e6:.1f} MFLOP/token | flop_ratio {s['flop_ratio']:.3f}"
    )


# ----------------------------------------------------------------------------------------------------------------
# entry point


def build_student(
    teacher: PreTrainedModel,
    cfg: DraftConfig,
    *,
    teacher_tokenizer: PreTrainedTokenizerBase | None = None,
    load_options: Mapping[str, object] | None = None,
) -> PreTrainedModel | PeftModel:
    """The student described by `cfg`, built from the loaded `teacher` (left untouched).

    A pretrained student (init=pretrained) is loaded with `load_options` and its vocabulary checked against
    `teacher_tokenizer`, see `pretrained_student`. With `cfg.lora` the result is a peft model: use `merge_student`
    to export it.
    """
    check_fits_teacher(cfg, teacher.config)
    match cfg.init:
        case "truncate":
            layers = cfg.layers or evenly_spaced_layers(teacher.config.num_hidden_layers, cfg.num_layers)
            student = truncate_student(teacher, layers)
        case "config":
            student = config_student(
                teacher,
                cfg.num_layers,
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.intermediate_size,
            )
        case "pretrained":
            if teacher_tokenizer is None:
                raise ValueError("init=pretrained needs the teacher's tokenizer to check the student's vocabulary")
            student = pretrained_student(teacher, cfg.pretrained, teacher_tokenizer, load_options)
    _check_no_shared_tensors(student, teacher)
    if cfg.lora:
        student = add_lora(student, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    return student


def check_fits_teacher(cfg: DraftConfig, teacher_config) -> None:
    """Refuse a draft section that does not fit the loaded teacher (the checks `DraftConfig` cannot make alone),
    naming the draft.* key: truncation keeps at most the teacher's layers; init=config's head counts must divide."""
    L = teacher_config.num_hidden_layers
    if cfg.init == "truncate" and cfg.layers is None and cfg.num_layers > L:
        raise UserError(f"draft.num_layers={cfg.num_layers} truncates a {L}-layer teacher; set it to at most {L}")
    if cfg.init == "truncate" and cfg.layers is not None and cfg.layers[-1] >= L:
        raise UserError(f"draft.layers={cfg.layers} must be indices in [0, {L - 1}] (the teacher's layers)")
    if cfg.init == "config":
        hidden = cfg.hidden_size or teacher_config.hidden_size
        heads = cfg.num_attention_heads or teacher_config.num_attention_heads
        kv_heads = cfg.num_key_value_heads or teacher_config.num_key_value_heads
        if hidden % heads or heads % kv_heads:
            raise UserError(
                f"draft: num_attention_heads {heads} must divide hidden_size {hidden}, and num_key_value_heads "
                f"{kv_heads} must divide num_attention_heads (unset sizes are the teacher's); change "
                "draft.hidden_size, draft.num_attention_heads or draft.num_key_value_heads"
            )


def _check_no_shared_tensors(student: nn.Module, teacher: nn.Module) -> None:
    """Training the student must never move the teacher: refuse any shared storage (e.g. a loader's cache)."""

    def storages(m: nn.Module) -> set[int]:
        return {
            t.untyped_storage().data_ptr()
            for t in [*m.parameters(), *m.buffers()]
            if t.numel() and t.device.type != "meta"
        }

    if storages(student) & storages(teacher):
        raise RuntimeError("the student shares tensors with the teacher; load or copy it separately")
