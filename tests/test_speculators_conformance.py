"""Conformance with an engine-side implementation (issue 23): the EAGLE-3 head `promote` exports, loaded by the
speculators package's own EAGLE-3 model (`Eagle3DraftModel`, vLLM's speculators), computes the same draft logits and
the same greedy drafts as our runtime's head (specdec_runtime/eagle3.py, loaded from the checkpoint eval measured)
on the same target hidden states and tokens; so does the head `speculators convert` makes with the command of the
model card, which keeps every tensor. A mis-mapped export fails the same check.

Tolerance: fp32 on both sides, `torch.testing.assert_close(rtol=1e-5, atol=1e-5)` on the target-id logits (-inf off
the draft vocabulary on both sides); greedy drafts equal token for token. The two agree to ~5e-7 here; every
mis-mapping below is off by more than 1e-2.

What is compared, per prompt x_0..x_{P-1} plus the target's next token x_P (shared/EAGLE3.md): the head's rows 0..P-1
(h_t with the embedding of x_{t+1}) at speculators' first step, then a greedy chain of DEPTH drafts from row P-1, our
runtime feeding its pre-norm outputs back with a cache, speculators unrolling its training-time-test steps with the
drafted tokens as the teacher-forced ones (its forward feeds each step's layer output back the same way). Each side
maps draft ids to target ids with its own d2t and reads the target layers it declares (speculators: its config's
eagle_aux_hidden_state_layer_ids), so a head converted without its aux layers reads other states and fails.
"""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
import torch
from helpers.reports import eagle3_run
from safetensors.torch import load_file, save_file

from eval.promote import promote
from specdec_runtime.eagle3 import Eagle3Cache, embed, target_aux_forward, to_target_logits

TOL = dict(rtol=1e-5, atol=1e-5)
DEPTH = 4
PROMPTS = [[5, 17, 3, 40, 22, 9, 101, 7], [60, 2, 33, 250, 11]]
# Only the first layer class and its loader warn about transformers' own renames and our explicit default-free ids.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An EAGLE-3 head with custom aux layers [1, 3, 5], promoted (and so exported) the one way serving gets it."""
    folder = tmp_path_factory.mktemp("eagle3")
    made = eagle3_run(folder, aux_layers=(1, 3, 5))
    promote(made.report, folder / "serving.yaml", expected_target=str(made.target_dir), export_root=folder / "export")
    made.export = folder / "export" / "eagle3"
    return made


# ------------------------------------------------------------------------------------------------ the two sides


def load_direct(speculators, export, target_dir):
    """Our export as speculators' Eagle3DraftModel: its config class built from our config.json, our tensors loaded
    under the one rename every reader of this layout applies (midlayer. -> layers.0.), the embeddings the target's."""
    from transformers import LlamaConfig

    ours = json.loads((export / "config.json").read_text())
    spec = speculators.Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig.from_pretrained(export),
        draft_vocab_size=ours["draft_vocab_size"],
        eagle_aux_hidden_state_layer_ids=ours["eagle_aux_hidden_state_layer_ids"],
        speculators_config=speculators.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[speculators.GreedyTokenProposalConfig(speculative_tokens=DEPTH)],
            default_proposal_method="greedy",
            verifier=speculators.VerifierConfig(name_or_path=str(target_dir), architectures=["LlamaForCausalLM"]),
        ),
    )
    spec.transformer_layer_config._attn_implementation = "sdpa"  # see `their_chain`
    model = speculators.Eagle3DraftModel(spec)
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(export / "model.safetensors").items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and sorted(missing) == [
        "embed_tokens.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]
    model.load_verifier_weights()  # embed_tokens (and the loss's verifier head) from the target's files
    return model.eval()


def load_converted(speculators, converted):
    """A `speculators convert` output through speculators' own from_pretrained."""
    spec = speculators.Eagle3SpeculatorConfig.from_pretrained(converted)
    spec.transformer_layer_config._attn_implementation = "sdpa"
    model = speculators.Eagle3DraftModel.from_pretrained(converted, config=spec)
    # The head has no embeddings of its own (the engines use the target's). speculators loads them from the verifier
    # only where its weight still holds the NaN its __init__ writes, but transformers 5's from_pretrained builds the
    # model on the meta device and materialises keys missing from the checkpoint uninitialised: whether they hold a
    # NaN depends on the allocator's leftovers (a flaky, order-dependent mismatch). Load the target's, as vLLM does.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model.eval()


def our_chain(head, target, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Our runtime's head on the prompt + x_P: (rows 0..P-1 target-id logits (P, V), the DEPTH chain steps' (V,))."""
    P = ids.shape[1] - 1
    _, aux = target_aux_forward(target, ids[:, :P], head.aux_layers(target.config.num_hidden_layers))
    cache, V = Eagle3Cache(), head.target_vocab
    logits, pre = head(aux, embed(target, ids[:, 1:]), torch.arange(P)[None], cache)  # (1, P, Vd), (1, P, H)
    rows = to_target_logits(logits[0], head.d2t, V)
    steps, hidden = [rows[-1]], pre[:, -1:]
    for k in range(1, DEPTH):
        token = steps[-1].argmax()[None, None]
        logits, hidden = head(hidden, embed(target, token), torch.tensor([[P - 1 + k]]), cache)
        steps.append(to_target_logits(logits[0, -1], head.d2t, V))
    return rows, steps


def their_chain(model, target, ids: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, list, list[int]]:
    """speculators' own forward over the prompt + x_P + our drafts d_1..d_{DEPTH-1} (its teacher-forced tokens),
    DEPTH training-time-test steps: (rows 0..P-1 of step 0, row P-1 of every step, its greedy drafts there), logits
    read at its lm_head and mapped to target ids with its own d2t (target id = i + d2t[i], as vLLM's proposer does).
    Attention runs through its SDPA path: its default, flex attention, needs compiled kernels and 128-token blocks,
    and the kernel does not change the maths."""
    P = ids.shape[1] - 1
    seq = torch.cat([ids, torch.tensor([drafts[:-1]])], 1)  # (1, P + DEPTH)
    _, aux = target_aux_forward(target, seq, list(model.config.eagle_aux_hidden_state_layer_ids))
    T, V = seq.shape[1] - 1, target.config.vocab_size
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out[0].detach()))
    try:
        with torch.no_grad():
            tokens = model(aux[:, :T], seq[:, 1:], torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None],
                           ttt_steps=DEPTH)  # fmt: skip
    finally:
        hook.remove()
    ids_of = torch.arange(model.d2t.shape[0]) + model.d2t  # (Vd,) target ids

    def scatter(logits):  # (..., Vd) -> (..., V), -inf elsewhere
        return logits.new_full((*logits.shape[:-1], V), float("-inf")).index_copy_(-1, ids_of, logits)

    greedy = [int(ids_of[step[0, P - 1]]) for step in tokens]
    return scatter(seen[0][:P]), [scatter(step[P - 1]) for step in seen], greedy


def assert_conforms(head, model, target) -> None:
    """The check of the module docstring, on every prompt; AssertionError names where the two part."""
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            x_P = target(ids).logits[:, -1].argmax(-1, keepdim=True)  # the target's next token
            ids = torch.cat([ids, x_P], 1)
            rows, steps = our_chain(head, target, ids)
        drafts = [int(step.argmax()) for step in steps]
        their_rows, their_steps, their_drafts = their_chain(model, target, ids, drafts)
        torch.testing.assert_close(their_rows, rows, **TOL, msg=lambda m, p=prompt: f"rows of {p}: {m}")
        for k, (theirs, ours) in enumerate(zip(their_steps, steps)):
            where = f"draft step {k} of {prompt}"
            torch.testing.assert_close(theirs, ours, **TOL, msg=lambda m, w=where: f"{w}: {m}")
        assert their_drafts == drafts, f"greedy drafts of {prompt}: speculators {their_drafts}, ours {drafts}"


def convert(speculators, command: str) -> None:
    """Run a `speculators convert ...` command line through speculators' own CLI (its typer app, in this process)."""
    argv = shlex.split(command)
    assert argv[:2] == ["speculators", "convert"], command
    speculators.typer.main.get_command(speculators.app).main(
        args=argv[1:], prog_name="speculators", standalone_mode=False
    )


def card_command(export) -> str:
    (line,) = [x for x in (export / "README.md").read_text().splitlines() if x.startswith("speculators convert ")]
    return line


# ------------------------------------------------------------------------------------------------ the checks


def test_speculators_runs_our_export_as_our_runtime_does(speculators, run):
    assert_conforms(run.head, load_direct(speculators, run.export, run.target_dir), run.target)


def test_the_cards_convert_command_keeps_every_tensor_and_the_aux_layers(speculators, run, tmp_path):
    """The model card's `speculators convert` command, run as written: every tensor of ours, unchanged (the converter
    loads non-strictly and would save random weights for a key it does not know), the aux layers in its config,
    and the converted head conforms too."""
    export = tmp_path / "eagle3"
    shutil.copytree(run.export, export)  # the card's paths: the command writes next to the export it names
    command = card_command(run.export).replace(str(run.export), str(export))
    assert '"eagle_aux_hidden_state_layer_ids": [1, 3, 5]' in command
    convert(speculators, command)
    converted = tmp_path / "eagle3-speculators"
    ours, theirs = load_file(export / "model.safetensors"), load_file(converted / "model.safetensors")
    assert sorted(theirs) == sorted(k.replace("midlayer.", "layers.0.") for k in ours)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name.replace("midlayer.", "layers.0.")], tensor), name
    config = json.loads((converted / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert_conforms(run.head, load_converted(speculators, converted), run.target)


@pytest.mark.filterwarnings("ignore:--target-layer-ids is not explicitly set:UserWarning")
def test_converting_without_the_aux_kwargs_serves_other_layers(speculators, run, tmp_path):
    """Why the command carries --algorithm-kwargs: the converter ignores config.json's ids, and the head it makes
    then reads the default layers [2, 4, 5] of this 8-layer target instead of [1, 3, 5], which the check catches."""
    command = card_command(run.export).replace(str(run.export), str(tmp_path / "eagle3"))
    shutil.copytree(run.export, tmp_path / "eagle3")
    convert(speculators, command.split(" --algorithm-kwargs ")[0])
    converted = tmp_path / "eagle3-speculators"
    assert json.loads((converted / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids") is None
    model = load_converted(speculators, converted)
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    with pytest.raises(AssertionError, match="rows of"):
        assert_conforms(run.head, model, run.target)


def swap(w: torch.Tensor, a: slice, b: slice, dim: int) -> torch.Tensor:
    w = w.clone()
    first, second = w.narrow(dim, a.start, a.stop - a.start).clone(), w.narrow(dim, b.start, b.stop - b.start).clone()
    w.narrow(dim, a.start, a.stop - a.start).copy_(second)
    w.narrow(dim, b.start, b.stop - b.start).copy_(first)
    return w


H = 32  # the tiny target's width
MISMAPPINGS = {
    # fc's rows in two halves, exchanged (a transposed / re-chunked projection)
    "fc halves swapped": lambda w: {"fc.weight": swap(w["fc.weight"], slice(0, H // 2), slice(H // 2, H), 0)},
    # fc's column blocks of the first and last aux layer exchanged (the layers concatenated in another order)
    "fc aux blocks swapped": lambda w: {"fc.weight": swap(w["fc.weight"], slice(0, H), slice(2 * H, 3 * H), 1)},
    # q/k/v read [hidden, embeds] instead of [embeds, hidden]
    "attention input halves swapped": lambda w: {
        k: swap(w[k], slice(0, H), slice(H, 2 * H), 1)
        for k in (f"midlayer.self_attn.{p}_proj.weight" for p in ("q", "k", "v"))
    },
    "d2t off by one": lambda w: {"d2t": w["d2t"] + 1},
}


@pytest.mark.parametrize("mismapping", MISMAPPINGS)
def test_a_mismapped_export_fails_the_check(speculators, run, tmp_path, mismapping):
    broken = tmp_path / "broken"
    shutil.copytree(run.export, broken)
    weights = load_file(broken / "model.safetensors")
    save_file({**weights, **MISMAPPINGS[mismapping](weights)}, broken / "model.safetensors")
    with pytest.raises(AssertionError):
        assert_conforms(run.head, load_direct(speculators, broken, run.target_dir), run.target)
