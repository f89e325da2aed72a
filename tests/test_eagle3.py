"""EAGLE-3 heads: the export layout the engines load (exact keys, dtypes, shapes, config keys, read by speculators),
the vocabulary maps, the cache, and that training-time test computes what inference drafts."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.models import eagle3_setup, tiny_llama
from helpers.runs import require_speculators
from safetensors.torch import load_file

from distill.eagle3 import LOG_ZERO, choose_draft_vocab, draft_targets, shift, ttt_logits, window
from distill.eagle3 import Packing as e3_packing
from distill.objectives import dense_from_support
from distill.students import DraftConfig
from eval.engines import ServingSetting, engine_snippets
from specdec_runtime.eagle3 import (
    Eagle3Cache,
    Eagle3Draft,
    check_aux_layers,
    embed,
    folded_gqa_attention,
    target_aux_forward,
    target_ids,
    to_target_logits,
    to_target_probs,
    ttt_mask,
    vocab_maps,
    weight_shapes,
)

DRAFT_IDS = torch.tensor([0, 2, 3, 7, 11, 20, 31, 40, 52, 63])
CONFIG_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "hidden_act", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id",
    "rope_parameters", "rope_theta", "rope_scaling", "torch_dtype", "eagle_aux_hidden_state_layer_ids", "eagle_config",
}  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=1, layers=6)  # 6 layers: default aux layers [2, 3, 3]


def head(target, aux=None, seed=0) -> Eagle3Draft:
    draft = Eagle3Draft.from_target(target, DRAFT_IDS, aux, seed=seed)
    with torch.no_grad():  # random norms and head too, so every weight matters to the outputs below
        for p in draft.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return draft.eval()


# ------------------------------------------------------------------------------------------------ the export layout


def test_export_has_exactly_the_engines_keys_dtypes_and_shapes(target, tmp_path):
    head(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config) == CONFIG_KEYS  # the aux layer ids too, default ones included (issue 23)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["tie_word_embeddings"]) == (1, False)
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (32, 64, len(DRAFT_IDS))
    assert (config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4, 2)
    assert config["rope_theta"] == target.config.rope_parameters["rope_theta"] and config["rope_scaling"] is None

    weights = load_file(tmp_path / "model.safetensors")
    expected = weight_shapes(config)
    assert set(weights) == set(expected)  # unprefixed, no embed_tokens, no layers.0.* (SGLang would drop those)
    H, Vd = 32, len(DRAFT_IDS)
    assert weights["fc.weight"].shape == (H, 3 * H) and weights["lm_head.weight"].shape == (Vd, H)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (32, 2 * H)  # q/k/v read [embeds, hidden]
    assert weights["midlayer.self_attn.k_proj.weight"].shape == (16, 2 * H)
    for name, tensor in weights.items():
        shape, dtype = expected[name]
        assert tuple(tensor.shape) == shape, name
        assert tensor.dtype == (dtype or torch.float32), name
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool


def test_aux_layers_are_always_written_for_vllm_and_sglang(target, tmp_path):
    """Default layers too: without the ids vLLM guesses per architecture (issue 23)."""
    head(target, aux=[1, 3, 5]).save_pretrained(tmp_path / "custom")
    config = json.loads((tmp_path / "custom" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # vLLM: layer inputs (HF indices)
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}  # SGLang: the same minus 1
    assert Eagle3Draft.from_pretrained(tmp_path / "custom").aux_layers(6) == [1, 3, 5]
    head(target).save_pretrained(tmp_path / "default")
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and head(target).aux_layers(6) == [2, 3, 3]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 2]}


def test_a_saved_head_loads_back_exactly_and_a_foreign_layout_is_refused(target, tmp_path):
    draft = head(target)
    draft.save_pretrained(tmp_path)
    loaded = Eagle3Draft.from_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    _, aux = target_aux_forward(target, ids, draft.aux_layers(6))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(aux, embed(target, ids), pos)[0], draft(aux, embed(target, ids), pos)[0])
    state = load_file(tmp_path / "model.safetensors")
    from safetensors.torch import save_file

    save_file({k.replace("midlayer.", "layers.0."): v for k, v in state.items()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not an EAGLE-3 draft of this layout"):
        Eagle3Draft.from_pretrained(tmp_path)


def test_speculators_reads_the_export(target, tmp_path):
    """vLLM's speculators package (not written here) builds its Eagle3SpeculatorConfig from our config.json and
    loads every one of our tensors into its EAGLE-3 model, with nothing missing or left over."""
    try:
        with warnings.catch_warnings():  # its import torch.compiles a module, which wakes torch's own deprecations
            warnings.filterwarnings("ignore", message=".*torch.jit.script_method", category=DeprecationWarning)
            from speculators.convert.eagle.eagle3_converter import Eagle3Converter
            from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator
            from speculators.models.eagle3 import Eagle3SpeculatorConfig
    except ImportError:
        require_speculators()
    target.save_pretrained(tmp_path / "target")
    head(target, aux=[1, 3, 5]).save_pretrained(tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    config["target_vocab_size"] = weights["t2d"].shape[0]  # what the converter reads from t2d
    spec = Eagle3Converter()._build_eagle3_speculator_config(
        config, str(tmp_path / "target"), eagle_aux_hidden_state_layer_ids=config["eagle_aux_hidden_state_layer_ids"]
    )
    assert isinstance(spec, Eagle3SpeculatorConfig)
    assert (spec.draft_vocab_size, spec.target_vocab_size, spec.norm_before_residual) == (len(DRAFT_IDS), 64, False)
    layer = spec.transformer_layer_config
    assert (layer.hidden_size, layer.head_dim, layer.num_key_value_heads, layer.num_hidden_layers) == (32, 8, 2, 1)
    model = Eagle3Speculator(
        config=spec, verifier=None, verifier_attachment_mode="detached", reduce_vocab_size=True,
        has_drafter_embedding=False,
    )  # fmt: skip
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}  # the converter's remapping
    model.load_state_dict(renamed, strict=True)  # raises on any missing, unexpected or mis-shaped tensor
    assert torch.equal(model.d2t, weights["d2t"]) and torch.equal(model.lm_head.weight, weights["lm_head.weight"])


# ------------------------------------------------------------------------------------------------ vocabulary maps


def test_d2t_and_t2d_describe_the_same_sorted_vocabulary():
    d2t, t2d = vocab_maps(DRAFT_IDS, 64)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.sum() == len(DRAFT_IDS)
    assert torch.equal(target_ids(d2t), DRAFT_IDS)  # target id = i + d2t[i]
    assert torch.equal(torch.nonzero(t2d)[:, 0], DRAFT_IDS)
    with pytest.raises(ValueError, match="strictly increasing"):
        vocab_maps(torch.tensor([3, 2, 7]), 64)
    with pytest.raises(ValueError, match="strictly increasing"):
        vocab_maps(torch.tensor([3, 64]), 64)


def test_draft_probabilities_scatter_to_target_ids_with_zero_elsewhere():
    d2t, t2d = vocab_maps(DRAFT_IDS, 64)
    logits = torch.randn(3, len(DRAFT_IDS))
    q = to_target_probs(logits.softmax(-1), d2t, 64)  # (3, 64)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert (q[:, ~t2d] == 0).all() and torch.equal(q[:, DRAFT_IDS], logits.softmax(-1))
    torch.testing.assert_close(to_target_logits(logits, d2t, 64).softmax(-1), q)  # -inf off-vocabulary, same q


def test_the_draft_vocabulary_is_the_most_frequent_tokens_and_its_coverage():
    counts = torch.tensor([5, 0, 9, 1, 0, 3]).numpy()
    ids, coverage = choose_draft_vocab(counts, 3)
    assert ids == [0, 2, 5] and coverage == pytest.approx(17 / 18)
    assert choose_draft_vocab(counts, 5)[0] == [0, 1, 2, 3, 5]  # never-seen fillers by ascending id


def test_cached_top_k_covering_everything_gives_the_online_targets(target):
    """The offline cache's sparse draft-vocabulary targets equal the online dense ones when its top-k holds every
    token: the teacher renormalised over the draft vocabulary, and the same positions masked."""
    draft = head(target)
    Vd = len(DRAFT_IDS)

    def dense(targets):
        return dense_from_support(targets.support_logits, targets.support_ids, Vd)

    logits = torch.randn(2, 5, 64)
    online, in_online = draft_targets(draft, logits, None)
    lp = logits.log_softmax(-1)
    values, ids = lp.topk(64, dim=-1)
    cached, in_cached = draft_targets(draft, None, (ids, values))
    assert cached.sparse and cached.support_logits.shape == (2, 5, 64)  # K of them, not the vocabulary's
    torch.testing.assert_close(dense(cached).log_softmax(-1), online.logits.log_softmax(-1))
    assert torch.equal(in_cached, in_online) and torch.equal(in_online, draft.t2d[logits.argmax(-1)])
    partial, _ = draft_targets(draft, None, (ids[..., :8], values[..., :8]))  # only the top 8: the rest vanishes
    kept = draft.t2d[ids[..., :8]].sum(-1)
    seen = kept > 0  # a position with no top-k token in the vocabulary has its argmax outside too: masked anyway
    # LOG_ZERO is finite (exp's fast range): each missing token keeps ~1e-38, nothing a loss can see
    assert seen.any() and torch.equal((dense(partial).softmax(-1) > 1e-30).sum(-1)[seen], kept[seen])
    # Padded by the unroll's depth, rows n .. n + T are the targets shifted by n (LOG_ZERO past the end), as views.
    for teacher in ((logits, None), (None, (ids, values))):
        plain, padded = draft_targets(draft, *teacher)[0], draft_targets(draft, *teacher, pad=3)[0]
        full = plain.logits if plain.logits is not None else dense(plain)
        assert (padded.logits if padded.logits is not None else padded.support_logits).shape[:2] == (2, 5 + 3)
        for n in (1, 2, 3):
            rows = window(padded, n, 5)
            got = rows.logits if rows.logits is not None else dense(rows)
            assert torch.equal(got, shift(full, n, LOG_ZERO)), n


@pytest.mark.parametrize("packed", [False, True])
def test_row_blocked_attention_is_sdpa_on_the_unrolls_masks(packed):
    """Blocks of query rows against only the keys they may see: the outputs and the gradients of one SDPA call, on
    the training-time-test masks of steps 0-2 ((R, S), or (B, 1, R, S) with packed sequences), with blocks that do
    and do not divide the rows; a block that sees every key takes them all."""
    from distill.eagle3 import ttt_rows_mask
    from specdec_runtime.eagle3 import row_blocked_attention

    g = torch.Generator().manual_seed(0)
    T = 37
    segments = torch.tensor([[0] * 12 + [1] * 15 + [2] * 10]) if packed else None
    rows = [torch.arange(T), torch.arange(T - 3), torch.arange(2, T - 6)]  # each step's rows, a subset of the last
    for j in range(3):
        mask = ttt_rows_mask(T, rows[: j + 1], segments)
        R, S = len(rows[j]), T + sum(len(r) for r in rows[1 : j + 1])
        q, k, v = (torch.randn(1, 4, n, 8, generator=g, requires_grad=True) for n in (R, S, S))
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
        for block in (5, 16, R):
            out = row_blocked_attention(q, k, v, mask, block=block)
            torch.testing.assert_close(out, expected)
            for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), grads):
                torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------------ cache and TTT


def test_an_incremental_forward_with_a_cropped_cache_matches_the_full_forward(target):
    draft = head(target)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    _, aux = target_aux_forward(target, ids, draft.aux_layers(6))
    emb, pos = embed(target, ids), torch.arange(10).expand(2, 10)
    with torch.no_grad():
        full, _ = draft(aux, emb, pos)
        cache = Eagle3Cache()
        draft(aux[:, :6], emb[:, :6], pos[:, :6], cache)
        draft(torch.randn(2, 2, 32), emb[:, 6:8], pos[:, 6:8], cache)  # drafted rows from own states...
        cache.crop(6)  # ...rolled back
        tail, _ = draft(aux[:, 6:], emb[:, 6:], pos[:, 6:], cache)
    torch.testing.assert_close(tail, full[:, 6:])
    assert cache.length == 10


def chain_draft(draft, aux, emb, t: int, depth: int, mask_fn=None) -> list[torch.Tensor]:
    """What an engine computes: rows 0..t from the target's states, then depth-1 drafted steps each feeding the
    previous pre-norm output, the next ground-truth token's embedding and position + 1 -> logits per step."""
    cache, out = Eagle3Cache(), []
    pos = torch.arange(t + 1)[None]
    logits, pre = draft(aux[:, : t + 1], shift(emb, 1, 0.0)[:, : t + 1], pos, cache)
    out.append(logits[:, -1])
    hidden = pre[:, -1:]
    for j in range(1, depth):
        logits, hidden = draft(hidden, emb[:, t + 1 + j : t + 2 + j], torch.tensor([[t + j]]), cache)
        out.append(logits[:, -1])
    return out


def test_training_time_test_computes_what_a_chain_draft_computes_at_inference(target, monkeypatch):
    """Step j of the unroll at row t equals the (j + 1)-th drafted token's logits after token t + 1 at inference:
    positions, the attention pattern and the fed-back pre-norm states all agree. A plain causal mask over the
    stacked keys (the obvious wrong pattern) must not."""
    import distill.eagle3

    draft, depth, T = head(target), 3, 12
    ids = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(2))
    _, aux = target_aux_forward(target, ids, draft.aux_layers(6))
    emb = embed(target, ids)
    with torch.no_grad():
        steps = [logits for _, logits in ttt_logits(draft, aux, emb, depth)]
        for t in (0, 4, T - depth - 1):
            for j, logits in enumerate(chain_draft(draft, aux, emb, t, depth)):
                torch.testing.assert_close(steps[j][:, t], logits, msg=f"row {t}, step {j}")
        wrong = lambda T, step, device, segments=None: torch.ones(T, (step + 1) * T, dtype=torch.bool).tril()  # noqa: E731
        monkeypatch.setattr(distill.eagle3, "ttt_mask", wrong)
        broken = [logits for _, logits in ttt_logits(draft, aux, emb, depth)]
    assert torch.equal(broken[0], steps[0])  # step 0 has no later keys: the same
    assert not torch.allclose(broken[2][:, 4], steps[2][:, 4], atol=1e-4)


@pytest.mark.parametrize("cache", [False, True])
def test_packed_sequences_train_the_head_exactly_as_padded_ones(monkeypatch, cache):
    """`draft.pack_sequences`: the micro-batch's sequences in one row give the padded batch's loss and gradients,
    from the teacher online or the cache, with every token trained (prompt ones too, so a row whose target lies in
    the next sequence would count); so does the loss applying lm_head to the valid rows itself (`distill.chunked_head`,
    lm_head trained here), padded or packed. Attending across sequences, or training rows whose target crosses into
    the next one, must not."""
    import distill.eagle3 as e3
    from distill.config import DistillConfig

    target, student, aux_layers, rows = eagle3_setup(prompt_topk=True, shapes=((4, 11), (2, 5), (3, 9)))
    embed_weight = e3.frozen_embedding(target, "cpu")
    batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=cache, loss_on_prompt=True)
    teacher, index = (None, torch.arange(batch["aux_hidden"].shape[-1])) if cache else (target, None)

    def loss_and_grads(pack: bool, fused: bool = False):
        draft_cfg = DraftConfig(init="eagle3", ttt_depth=3, pack_sequences=pack)
        student.zero_grad()
        head = student.lm_head.weight if fused else None
        loss = e3.eagle3_loss(student, embed_weight, teacher, batch, 7, draft_cfg, DistillConfig(), index,
                              aux_layers=aux_layers, lm_head_weight=head)  # fmt: skip
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    padded, padded_grads = loss_and_grads(False)
    assert "lm_head.weight" in padded_grads and len(padded_grads) > 5
    for pack, fused in [(True, False), (False, True), (True, True)]:
        loss, grads = loss_and_grads(pack, fused)
        torch.testing.assert_close(loss, padded, msg=f"pack={pack} fused={fused}")
        assert grads.keys() == padded_grads.keys()
        for name, grad in padded_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=f"{name} pack={pack} fused={fused}")

    real_mask = e3.ttt_rows_mask  # what the training loss masks with (`trained_only`)
    monkeypatch.setattr(e3, "ttt_rows_mask", lambda T, rows, segments=None: real_mask(T, rows))
    assert not torch.allclose(loss_and_grads(True)[0], padded, rtol=1e-3)  # attends the previous sequences
    monkeypatch.setattr(e3, "ttt_rows_mask", real_mask)
    monkeypatch.setattr(e3.Packing, "same", lambda self, n: torch.ones_like(self.segments, dtype=torch.bool))
    assert not torch.allclose(loss_and_grads(True)[0], padded, rtol=1e-3)  # learns across the boundaries


@pytest.mark.parametrize("cache", [False, True])
def test_the_unroll_computes_only_the_rows_a_loss_reads_with_the_same_loss_and_gradients(monkeypatch, cache):
    """With the loss on response tokens only, step j computes the rows some step >= j trains (and step 0 every
    row's key and value): the full unroll's loss and gradients, padded or packed, lm_head in the forward or in the
    loss, online or from the cache. A row mask that lets a row see another row's key of a later step must not."""
    import distill.eagle3 as e3
    from distill.config import DistillConfig

    shapes = ((9, 12), (3, 7), (11, 13))  # long prompts, short answers: most rows are read by no loss
    target, student, aux_layers, rows = eagle3_setup(prompt_topk=False, shapes=shapes)
    embed_weight = e3.frozen_embedding(target, "cpu")
    batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=cache)
    teacher, index = (None, torch.arange(batch["aux_hidden"].shape[-1])) if cache else (target, None)
    computed = []
    real_rows = e3.trained_rows
    monkeypatch.setattr(e3, "trained_rows", lambda masks: computed.append(real_rows(masks)) or computed[-1])

    def loss_and_grads(pack: bool, fused: bool, trained_only: bool):
        draft_cfg = DraftConfig(init="eagle3", ttt_depth=3, pack_sequences=pack)
        student.zero_grad()
        view = e3.teacher_view(teacher, batch, aux_layers, index)
        steps = e3.unrolled_steps(
            student, embed_weight, batch, view, draft_cfg, DistillConfig(), 7, pack=pack, trained_only=trained_only,
            lm_head_weight=student.lm_head.weight if fused else None,
        )  # fmt: skip
        loss = sum(draft_cfg.ttt_decay**j * loss for j, _, loss, _ in steps)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    for pack, fused in [(False, False), (True, False), (False, True), (True, True)]:
        full, full_grads = loss_and_grads(pack, fused, trained_only=False)
        loss, grads = loss_and_grads(pack, fused, trained_only=True)
        torch.testing.assert_close(loss, full, msg=f"pack={pack} fused={fused}")
        assert grads.keys() == full_grads.keys() and len(grads) > 5
        for name, grad in full_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=f"{name} pack={pack} fused={fused}")
    for skip in (False, True):  # the training loss follows draft.skip_untrained_rows
        before = len(computed)
        cfg = DraftConfig(init="eagle3", ttt_depth=3, skip_untrained_rows=skip)
        e3.eagle3_loss(student, embed_weight, teacher, batch, 7, cfg, DistillConfig(), index, aux_layers=aux_layers)
        assert len(computed) == before + skip
    # the packed batch's 32 rows: a sequence of length n with a prompt of P trains labels P - 1 .. n - 2 (row t's
    # label is token t + 1), which step k reads at rows P - 2 - k .. n - 3 - k: step j computes rows P - 4 .. n - 3 - j
    packed = computed[-1]
    starts = [0, 12, 19]
    want = [[s + t for s, (P, n) in zip(starts, shapes) for t in range(max(P - 4, 0), n - 2 - j)] for j in range(3)]
    assert [r.tolist() for r in packed] == want and [len(r) for r in packed] == [14, 11, 8]
    assert all(set(later.tolist()) <= set(earlier.tolist()) for earlier, later in zip(packed, packed[1:]))

    batch["labels"][:] = -100  # a micro-batch no loss reads (a pass of prompts only): nothing to compute, and
    for pack, fused in [(False, False), (True, False), (False, True), (True, True)]:  # every parameter still gets
        loss, grads = loss_and_grads(pack, fused, trained_only=True)  # its zero gradient (DDP waits for each one)
        assert loss == 0 and len(grads) == len(full_grads) and all(not g.any() for g in grads.values())
        assert [len(r) for r in computed[-1]] == [0, 0, 0]
    batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=cache)

    real_mask = e3.ttt_rows_mask

    def leaky(T, rows, segments=None):  # the step-0 keys as they are, every key of the later steps visible
        mask = real_mask(T, rows, segments).clone()
        mask[..., T:] = True
        return mask

    monkeypatch.setattr(e3, "ttt_rows_mask", leaky)
    assert not torch.allclose(loss_and_grads(True, True, trained_only=True)[0], full, rtol=1e-3)


def test_heads_whose_attention_reads_positions_of_the_whole_call_compute_every_row(target):
    """A sliding window compares positions with key indices, a dynamic rotary embedding rescales with a call's
    largest position: with rows skipped, neither would see what the full unroll sees."""
    import distill.eagle3 as e3

    assert e3.rows_can_be_skipped(head(target))
    windowed, dynamic = head(target), head(target)
    windowed.midlayer.self_attn.sliding_window = 4
    dynamic.rotary.rope_type = "dynamic"
    assert not e3.rows_can_be_skipped(windowed) and not e3.rows_can_be_skipped(dynamic)


def test_ttt_rows_mask_of_every_row_is_ttt_mask():
    from distill.eagle3 import ttt_rows_mask

    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2]])
    every = [torch.arange(7)] * 3
    for step in range(3):
        assert torch.equal(ttt_rows_mask(7, every[: step + 1]), ttt_mask(7, step, torch.device("cpu")))
        assert torch.equal(ttt_rows_mask(7, every[: step + 1], segments), ttt_mask(7, step, "cpu", segments))
    some = [torch.tensor([1, 2, 4, 6]), torch.tensor([2, 4, 6]), torch.tensor([4, 6])]
    keys = [*range(7), 7 + 2, 7 + 4, 7 + 6, 14 + 4, 14 + 6]  # step 0's, then step 1's and 2's of the rows kept
    assert torch.equal(ttt_rows_mask(7, some), ttt_mask(7, 2, torch.device("cpu"))[[4, 6]][:, keys])


def test_packing_refuses_a_head_with_a_sliding_window():
    """A sliding window counts keys by their index in the row, which packing makes differ from their positions."""
    import distill.eagle3 as e3
    from distill.config import DistillConfig
    from specdec_runtime.errors import UserError

    target, student, aux_layers, rows = eagle3_setup(prompt_topk=False)
    student.midlayer.self_attn.sliding_window = 4
    batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=False)
    embed_weight = e3.frozen_embedding(target, "cpu")
    draft_cfg = DraftConfig(init="eagle3", ttt_depth=2)
    with pytest.raises(UserError, match="pack_sequences=false"):
        e3.eagle3_loss(student, embed_weight, target, batch, 1, draft_cfg, DistillConfig(), None, aux_layers=aux_layers)
    unpacked = DraftConfig(init="eagle3", ttt_depth=2, pack_sequences=False)
    assert (
        e3.eagle3_loss(student, embed_weight, target, batch, 1, unpacked, DistillConfig(), None, aux_layers=aux_layers)
        > 0
    )


@pytest.mark.parametrize("cached", [False, True])
def test_validation_sums_do_not_depend_on_the_chunk_of_positions(cached):
    """The validation measures each row distill.chunk_size positions at a time (the target-vocabulary logits of one
    chunk exist at once): the sums of every unrolled step equal those of whole rows, with the teacher online and
    from the cache, and chunks that hold no measured position skipped."""
    import distill.eagle3 as e3
    from distill.config import DistillConfig

    target, student, aux_layers, rows = eagle3_setup(prompt_topk=False, shapes=((4, 11), (6, 13), (3, 7)))
    batch = e3.collate_eagle3(rows, max_seq_len=64, pad_id=0, topk=cached)
    embed_weight = e3.frozen_embedding(target, "cpu")
    draft_cfg = DraftConfig(init="eagle3", ttt_depth=3)
    teacher, index = (None, torch.arange(batch[e3.AUX_COLUMN].shape[-1])) if cached else (target, None)
    sums = [
        e3.eagle3_validation_sums(
            student,
            embed_weight,
            teacher,
            batch,
            draft_cfg,
            DistillConfig(chunk_size=size),
            index,
            aux_layers=aux_layers,
        )  # fmt: skip
        for size in (1000, 3, 5)
    ]
    assert sums[0][2:].abs().sum() > 0
    for other in sums[1:]:
        torch.testing.assert_close(other, sums[0])


def test_packing_concatenates_the_real_positions_and_counts_positions_per_sequence():
    packing = e3_packing.of(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert packing.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert packing.position.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packing(torch.arange(12).view(3, 4)).tolist() == [[0, 1, 2, 4, 5, 8, 9, 10, 11]]
    assert packing.same(2).tolist() == [[True, False, False, False, False, True, True, False, False]]
    mask = ttt_mask(9, 1, torch.device("cpu"), packing.segments)  # (1, 1, 9, 18)
    assert mask.shape == (1, 1, 9, 18) and mask[0, 0, 4, :9].tolist() == [False] * 3 + [True] * 2 + [False] * 4
    assert torch.equal(mask[0, 0, :, 9:], torch.eye(9, dtype=torch.bool))


def test_ttt_mask_is_causal_on_step_zero_and_diagonal_after():
    mask = ttt_mask(3, 2, torch.device("cpu"))
    assert mask.shape == (3, 9)
    assert torch.equal(mask[:, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(mask[:, 3:6], torch.eye(3, dtype=torch.bool)) and torch.equal(mask[:, 6:], mask[:, 3:6])


# ------------------------------------------------------------------------------------------------ numerics


def test_the_heads_rope_frequencies_stay_fp32_through_every_cast(target, tmp_path):
    """bf16 frequencies are off by up to 2^-9 relative, ~2e-3 rad per token of distance: the head would see other
    positions than it trained on, and than vLLM / SGLang give it. Whatever casts the head (the runtime's loader,
    `.to`, `.bfloat16()` as DeepSpeed 0.19.0-0.19.2's bf16 engine does, `.half()`), inv_freq stays the fp32
    original, and bf16 cos / sin at large positions are fp32 frequencies' rounded once. (DeepSpeed 0.19.3+ casts
    parameters only: tests/test_eagle3_train.py checks the head inside its engine.)"""
    fp32 = head(target).rotary
    head(target).to(torch.bfloat16).save_pretrained(tmp_path)
    casts = {
        "from_pretrained": lambda d: Eagle3Draft.from_pretrained(tmp_path),
        ".to(bf16)": lambda d: d.to(torch.bfloat16),
        ".to(dtype=)": lambda d: d.to(device="cpu", dtype=torch.bfloat16),
        ".bfloat16()": lambda d: d.bfloat16(),
        ".half()": lambda d: d.half(),
    }
    for name, cast in casts.items():
        draft = cast(head(target))
        assert draft.fc.weight.dtype in (torch.bfloat16, torch.float16), name
        for buffer in ("inv_freq", "original_inv_freq"):
            freqs = getattr(draft.rotary, buffer)
            assert freqs.dtype == torch.float32 and torch.equal(freqs, getattr(fp32, buffer)), (name, buffer)
    x, positions = torch.zeros(1, dtype=torch.bfloat16), torch.arange(3000, 3100)[None]
    cos, sin = head(target).bfloat16().rotary(x, positions)
    want_cos, want_sin = (t.to(torch.bfloat16) for t in fp32(x.float(), positions))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_folded_gqa_attention_is_sdpas_gqa_in_outputs_and_gradients():
    """Training folds each key head's query heads into its rows: equal head counts, which CUDA's memory-efficient
    kernel takes (GQA with a mask leaves CUDA the math kernel only). The outputs and the gradients of q, k and v are
    SDPA's enable_gqa ones, under the TTT mask and under an engine's (B, 1, T, S) one."""
    gen = torch.Generator().manual_seed(0)
    B, Hq, KV, T, D, step = 2, 6, 2, 5, 8, 2
    S = (step + 1) * T
    q = torch.randn(B, Hq, T, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, KV, S, D, generator=gen, requires_grad=True) for _ in range(2))
    w = torch.randn(B, Hq, T, D, generator=gen)
    ttt = ttt_mask(T, step, torch.device("cpu"))
    sparse = ttt & (torch.rand(B, 1, T, S, generator=gen) < 0.6)
    sparse[..., :T] |= torch.eye(T, dtype=torch.bool)  # every row keeps its own step-0 key
    for mask in (ttt, sparse):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = folded_gqa_attention(q, k, v, mask)
        torch.testing.assert_close(got, want)
        grads, want_grads = (torch.autograd.grad((out * w).sum(), (q, k, v)) for out in (got, want))
        for g, ref in zip(grads, want_grads):
            torch.testing.assert_close(g, ref)


def test_the_heads_cpu_training_attention_repeats_the_keys_and_broadcasts_the_mask(target, monkeypatch):
    """With autograd recording on the CPU, every attention of the TTT unroll reaches SDPA with the keys and values
    repeated to the query heads and a mask with one head dimension (broadcast: SDPA's float copy of it, kept for
    backward, is not repeated per query head as `folded_gqa_attention`'s would be); without (drafting, validation),
    it stays SDPA's GQA over the KV heads. Both give the same logits (CUDA's folded form: the test above)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        mask = kwargs.get("attn_mask")
        calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False), mask.dim() < 4 or mask.shape[1] == 1))
        return sdpa(q, k, v, **kwargs)

    draft, T = head(target).train(), 7
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, aux = target_aux_forward(target, ids, draft.aux_layers(6))
        emb = embed(target, ids)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)  # torch's own: after the target's forward
    training = [logits for _, logits in ttt_logits(draft, aux, emb, 3)]
    assert calls == [(4, 4, False, True)] * 3  # tiny_llama: 4 query heads, 2 key heads
    calls.clear()
    with torch.no_grad():
        drafting = [logits for _, logits in ttt_logits(draft, aux, emb, 3)]
    assert calls == [(4, 2, True, True)] * 3
    for got, want in zip(training, drafting):
        torch.testing.assert_close(got.detach(), want)


def test_a_new_heads_initialisation_follows_init_std_and_norm_from_target():
    """torch's default or normal(0, init_std) for fc and the layer's linears (what speculators starts from), the
    final norm from the target's or ones; lm_head is the target's rows either way, and the same seed the same head."""
    target = tiny_llama(seed=1, layers=6, hidden_size=64, intermediate_size=256)  # enough weights for a std to be read
    with torch.no_grad():
        target.model.norm.weight.uniform_(1.5, 2.5)  # a trained norm, not the ones a new RMSNorm starts at
    linears = ["fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.o_proj", "midlayer.mlp.down_proj"]

    default = Eagle3Draft.from_target(target, DRAFT_IDS, seed=0)
    for name in linears:  # Kaiming uniform: bounded by 1 / sqrt(fan_in), std 1 / sqrt(3 fan_in)
        w = default.get_submodule(name).weight
        assert w.abs().max() <= 1 / w.shape[1] ** 0.5
        assert w.std().item() == pytest.approx(1 / (3 * w.shape[1]) ** 0.5, rel=0.1)
    assert torch.equal(default.norm.weight, target.model.norm.weight)

    normal = Eagle3Draft.from_target(target, DRAFT_IDS, seed=0, init_std=0.02, norm_from_target=False)
    for name in linears:
        w = normal.get_submodule(name).weight
        assert w.std().item() == pytest.approx(0.02, rel=0.1) and w.abs().max() > 2.5 * 0.02  # a normal's tails
    assert torch.equal(normal.norm.weight, torch.ones_like(normal.norm.weight))
    for head in (default, normal):
        assert torch.equal(head.lm_head.weight, target.lm_head.weight[DRAFT_IDS])
    again = Eagle3Draft.from_target(target, DRAFT_IDS, seed=0, init_std=0.02, norm_from_target=False)
    assert all(torch.equal(a, b) for a, b in zip(normal.state_dict().values(), again.state_dict().values()))


# ------------------------------------------------------------------------------------------------ config and engines


def test_draft_config_validates_the_eagle3_keys():
    DraftConfig(init="eagle3", aux_layers=[1, 2, 3], ttt_depth=7, ttt_decay=1.0, freeze_lm_head=True)
    for bad, match in [
        (dict(init="truncate", aux_layers=[1, 2, 3]), "only used by init=eagle3"),
        (dict(init="eagle3", aux_layers=[1, 2]), "3 layer indices"),
        (dict(init="eagle3", aux_layers=[0, 2, 3]), "3 layer indices"),
        (dict(init="eagle3", aux_layers=[3, 1, 2]), "ascending order"),  # engines concatenate in layer order
        (dict(init="eagle3", lora=True), "lora does not apply"),
        (dict(init="eagle3", ttt_decay=0.0), "ttt_decay"),
        (dict(init="eagle3", ttt_depth=0), "ttt_depth"),
        (dict(init="eagle3", draft_vocab_size=0), "draft_vocab_size"),
        (dict(init="eagle3", init_std=-0.02), "init_std"),
        (dict(init="truncate", norm_output=True), "norm_output only apply to init=eagle3"),
    ]:
        with pytest.raises(ValueError, match=match):
            DraftConfig(**bad)
    with pytest.raises(ValueError, match=r"\[1, 5\]"):
        check_aux_layers([2, 3, 6], 6)  # index L is the final normed output, not a layer input
    with pytest.raises(ValueError, match="ascending order"):
        check_aux_layers([4, 2, 3], 6)


def test_engine_snippets_name_the_eagle3_method_of_every_engine():
    snippets = engine_snippets(ServingSetting("/d", 4, kind="eagle3", aux_layers=(2, 3, 3)))
    assert snippets["vllm"]["speculative_config"] == {"model": "/d", "num_speculative_tokens": 4, "method": "eagle3"}
    sglang = snippets["sglang"]
    flags = dict(zip(sglang[::2], sglang[1::2]))
    assert flags == {
        "--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": "/d", "--speculative-num-steps": 4,
        "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 5,
    }  # fmt: skip
    assert snippets["trtllm"]["speculative_config"] == {
        "decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "/d", "eagle3_layers_to_capture": [1, 2, 2],
    }  # fmt: skip
    assert engine_snippets(ServingSetting("/d", 4))["sglang"][1] == "STANDALONE"
    with pytest.raises(ValueError, match="required for kind eagle3"):
        ServingSetting("/d", 4, kind="eagle3")  # a head's snippet without its layers would serve the default ones


def test_the_standalone_loader_refuses_an_eagle3_head(target, tmp_path):
    """transformers would read config.json as a plain Llama and load it with random weights, silently."""
    from specdec_runtime.loading import ModelLoadError, load_checkpoint

    head(target).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="EAGLE-3 head"):
        load_checkpoint(tmp_path)
