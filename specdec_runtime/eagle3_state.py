"""The engine's cache states for an EAGLE-3 draft (shared/EAGLE3.md; Li et al. 2025): the target's state also hands
over the aux hidden states of every token it scores, and the draft's state feeds them to the head.

    target_state, draft_state = eagle3_states(target, draft, batch_size, max_len)   # engine.generate does this

Both implement the state interface of kv.py, so chains, static trees and dynamic (EAGLE-2) trees run unchanged:

- `AuxTargetState` wraps the target's own state (HF dynamic cache or the compact static cache). Forward pre-hooks on
  the aux layers copy each layer's input into a persistent buffer during the target's forward (one forward, no
  `output_hidden_states`), and the wrapper files the (B, T, 3H) features by position: chain columns as they are
  scored, a tree's path columns when `tree_commit` keeps them. The hooks copy into buffers that outlive the call, so
  a CUDA graph of the compact model records the copies and its replays refresh them.
- `Eagle3State` drives the head with the engine's token bookkeeping (the draft "holds" the tokens it was fed). Draft
  row r pairs the hidden state of position r with the embedding of token r + 1 (rope position r) and predicts token
  r + 2, so feeding token x at position p computes row p - 1. A row's hidden state is the target's feature of
  position r (through `fc`) when the target has scored r, else the pre-norm output of row r - 1 (the head's own
  guess: drafted tokens). Rolling back keeps only rows fed target features: rows fed the head's own states are
  recomputed from the target's features at the next extend (even for accepted tokens), as EAGLE does.

Draft logits leave the state over target ids, -inf off the draft vocabulary (`to_target_logits`): warped and
softmaxed, q is exactly 0 there, so the rejection sampling of the chain and the trees stays exact.
"""

import weakref
from functools import partial

import torch
from torch import Tensor, nn

from .eagle3 import Eagle3Draft, to_target_logits
from .kv import hole_layout, make_state
from .llama import Llama, StaticState

__all__ = ["AuxCapture", "AuxTargetState", "Eagle3State", "eagle3_states"]


# ------------------------------------------------------------------------------------------------ the target's side


class AuxCapture:
    """Forward pre-hooks copying the inputs of some decoder layers into persistent (rows, T, H) buffers.

    HF `output_hidden_states[i]` is the input of layer i, so hooking layer i's input gives exactly those features.
    """

    def __init__(self, layers: list[nn.Module]):
        self.bufs: list[Tensor | None] = [None] * len(layers)
        self.handles = [
            layer.register_forward_pre_hook(partial(self._hook, i), with_kwargs=True) for i, layer in enumerate(layers)
        ]

    def reserve(self, rows: int, width: int, like: Tensor) -> bool:
        """Buffers of at least (rows, width) with `like`'s dtype and device; True when they were reallocated."""
        grown = False
        for i, buf in enumerate(self.bufs):
            if buf is None or buf.shape[0] < rows or buf.shape[1] < width or buf.dtype != like.dtype:
                self.bufs[i] = like.new_zeros(rows, width, like.shape[-1])
                grown = True
        return grown

    def _hook(self, i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["hidden_states"]  # (B, T, H) the layer's input
        B, T, _ = x.shape
        buf = self.bufs[i]
        if buf is None or buf.shape[0] < B or buf.shape[1] < T or buf.dtype != x.dtype:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():  # a graph must copy into memory that outlives it
                raise RuntimeError("aux buffers too small inside a CUDA graph capture; reserve them first")
            self.reserve(B, T, x)
        self.bufs[i][:B, :T].copy_(x)

    def read(self, B: int, T: int) -> Tensor:
        """The latest forward's features (B, T, 3H), in aux-layer order; a copy (the next forward overwrites)."""
        return torch.cat([buf[:B, :T] for buf in self.bufs], -1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of the compact model or of an HF causal LM."""
    return model.layers if isinstance(model, Llama) else model.base_model.layers


def embedding(model: nn.Module) -> nn.Embedding:
    """The target's token embedding, which the head shares."""
    return model.embed_tokens if isinstance(model, Llama) else model.get_input_embeddings()


def capture_for(target: nn.Module, aux_layers: list[int], state) -> AuxCapture:
    """Hooks on the target's aux layers for one generate call.

    The compact model's CUDA graphs bake the copies in, so on that path the capture lives on the model across calls
    and its buffers follow the static cache's shape (graphs captured before the hooks, or against smaller buffers,
    are dropped). Elsewhere the hooks go away with the state.
    """
    layers = decoder_layers(target)
    if not (isinstance(state, StaticState) and target.device.type == "cuda" and target.use_graphs):
        capture = AuxCapture([layers[i] for i in aux_layers])
        weakref.finalize(state, capture.close)
        return capture
    kept = target.eagle3_capture
    if kept is None or kept[0] != tuple(aux_layers):
        if kept is not None:
            kept[1].close()
        kept = (tuple(aux_layers), AuxCapture([layers[i] for i in aux_layers]))
        target.eagle3_capture, target.graphs, target.graph_pool = kept, {}, None
        kept[1].reserve(*target.cache_shape, target.embed_tokens.weight)
    elif kept[1].reserve(*target.cache_shape, target.embed_tokens.weight):
        target.graphs, target.graph_pool = {}, None  # they copy into the old buffers
    return kept[1]


class AuxTargetState:
    """The target's state, plus the aux features (B, S, 3H) of every position it has scored (`features`)."""

    def __init__(self, state, aux_layers: list[int], max_len: int):
        self.state = state
        self.capture = capture_for(state.model, aux_layers, state)
        self.max_len = max_len  # positions 0..max_len - 1, plus one trash slot for holes
        self.feats: Tensor | None = None  # (B, max_len + 1, 3H)
        self.tree_feats: Tensor | None = None  # (B, W, 3H) of the uncommitted tree segment

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def lengths(self) -> Tensor:
        return self.state.lengths

    def _write(self, positions: Tensor, keep: Tensor, feats: Tensor) -> None:
        """File feats (B, T, 3H) at positions (B, T) where keep (B, T); the rest goes to the trash slot."""
        if self.feats is None:
            self.feats = feats.new_zeros(feats.shape[0], self.max_len + 1, feats.shape[-1])
        rows = torch.arange(feats.shape[0], device=feats.device)[:, None]
        self.feats[rows, torch.where(keep, positions, self.max_len)] = feats

    def features(self, positions: Tensor) -> Tensor:
        """(B, R) positions -> (B, R, 3H) their filed features (positions must be scored)."""
        index = positions.clamp(0, self.max_len)[..., None].expand(-1, -1, self.feats.shape[-1])
        return self.feats.gather(1, index)

    def extend(self, tokens: Tensor, counts: Tensor, last_only: bool = False, new_rows: int | None = None) -> Tensor:
        valid, positions = hole_layout(counts, self.state.lengths, tokens.shape[1])
        logits = self.state.extend(tokens, counts, last_only, new_rows)
        self._write(positions, valid, self.capture.read(*tokens.shape))
        return logits

    def rollback(self, drop: Tensor) -> None:
        self.state.rollback(drop)  # features past the new lengths are stale and never read

    def tree_forward(self, tokens: Tensor, positions: Tensor, seen: Tensor) -> Tensor:
        logits = self.state.tree_forward(tokens, positions, seen)
        feats = self.capture.read(*tokens.shape)
        self.tree_feats = feats if self.tree_feats is None else torch.cat([self.tree_feats, feats], 1)
        return logits

    def tree_commit(self, cols: Tensor, counts: Tensor) -> None:
        start = self.state.lengths  # (B,) the path lands at start, start + 1, ...
        if self.tree_feats is not None:
            K = cols.shape[1]
            index = cols.clamp_min(0)[..., None].expand(-1, -1, self.tree_feats.shape[-1])
            steps = torch.arange(K, device=cols.device)
            self._write(start[:, None] + steps, steps < counts[:, None], self.tree_feats.gather(1, index))
            self.tree_feats = None
        self.state.tree_commit(cols, counts)

    def select(self, keep: list[int]) -> None:
        self.state.select(keep)
        if self.feats is not None:
            self.feats = self.feats[torch.tensor(keep, device=self.feats.device)]


# ------------------------------------------------------------------------------------------------- the draft's side


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor back to the host costs nothing: on the CPU there is no device to wait for."""
    return device.type == "cpu"


class SlotCache:
    """The head's keys and values in per-row slots (rows, S, KV, D); `append` writes a call's rows at `slots` (B, T)
    and returns every slot as (B, KV, S, D), which the call's mask narrows down."""

    def __init__(self, k: Tensor, v: Tensor, slots: Tensor):
        self.k, self.v, self.slots = k, v, slots

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)[:, None]
        self.k[rows, self.slots] = k.transpose(1, 2)  # (B, T, KV, D)
        self.v[rows, self.slots] = v.transpose(1, 2)
        return self.k[:B].transpose(1, 2), self.v[:B].transpose(1, 2)


class Eagle3State:
    """The head's state over a ragged batch, fed by the engine like any draft (module docstring)."""

    def __init__(self, draft: Eagle3Draft, target: AuxTargetState, embed: nn.Embedding, batch_size: int, max_len: int):
        self.model, self.target, self.embed = draft, target, embed
        cfg, dtype, dev = draft.config, draft.compute_dtype, draft.norm.weight.device
        self.S = max_len + 1  # slot r holds row r; the last slot is the trash slot of holes
        shape = (batch_size, self.S, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)
        self.pre = torch.zeros(batch_size, self.S, cfg.hidden_size, dtype=dtype, device=dev)  # (B, S, H) pre-norm
        self.tokens = torch.zeros(batch_size, self.S, dtype=torch.long, device=dev)  # token at each position
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=dev)  # tokens fed = the engine's view
        self.rows = torch.zeros_like(self.lengths)  # rows 0..rows-1 are in the cache
        self.fed = torch.zeros_like(self.lengths)  # rows 0..fed-1 were fed target features
        self.segment = 0  # uncommitted tree rows, in the slots after each row's `rows`
        self.seg_pre, self.seg_tokens = self.pre[:, :0], self.tokens[:, :0]  # (B, W, H), (B, W) of those rows

    def _run(self, hidden: Tensor, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, last_only: bool):
        """One head forward over rows (B, R): hidden (B, R, H), next tokens, rope positions, cache slots, mask
        (B, 1, R, S) -> target-id logits (B, R or 1, V) fp32 and pre-norm outputs (B, R, H)."""
        embeds = self.embed(tokens).to(hidden.dtype)
        cache = SlotCache(self.k, self.v, slots)
        logits, pre = self.model(hidden, embeds, positions, cache, mask, last_only=last_only)
        return to_target_logits(logits.float(), self.model.d2t, self.model.target_vocab), pre

    def _hidden(self, r: Tensor, from_target: Tensor) -> Tensor:
        """Rows r (B, R) -> their hidden states (B, R, H): fc(target features of r), or row r - 1's pre-norm."""
        own = self.pre.gather(1, (r - 1).clamp_min(0)[..., None].expand(-1, -1, self.pre.shape[-1]))
        # A drafting step computes fc (3H -> H) for nothing; skipping it takes a host read, free on the CPU only (CUDA
        # computes fc rather than wait for the device).
        if reads_are_free(r.device) and not bool(from_target.any()):
            return own
        features = self.target.features(r).to(self.model.compute_dtype)
        return torch.where(from_target[..., None], self.model.fc(features), own)

    def extend(self, tokens: Tensor, counts: Tensor, last_only: bool = False, new_rows: int | None = None) -> Tensor:
        """new_rows: R, the most rows any batch row computes (kv.py), from the engine: reading it off the device
        would cost a host sync per draft forward."""
        if not last_only or new_rows is None:
            raise ValueError(
                "an EAGLE-3 draft state returns the last fed token's logits only (last_only=True) and takes the most "
                "rows a batch row computes from its caller (new_rows=R)"
            )
        B, T = tokens.shape
        valid, positions = hole_layout(counts, self.lengths, T)
        rows_idx = torch.arange(B, device=tokens.device)[:, None]
        self.tokens[rows_idx, torch.where(valid, positions, self.S - 1)] = tokens
        self.lengths = self.lengths + counts
        new = (self.lengths - 1 - self.rows).clamp_min(0)  # (B,) rows to compute: rows .. lengths - 2
        R = new_rows  # >= max(new); rows with fewer are padded on the left, like holes
        if R == 0:  # one-token prompts at prefill: no row has a next token yet
            return torch.zeros(B, 1, self.model.target_vocab, device=tokens.device)
        live, r = hole_layout(new, self.rows, R)  # (B, R) right-aligned rows
        from_target = r < self.target.lengths[:, None]  # the target scored position r; else only r == rows
        slots = torch.where(live, r, self.S - 1)
        cols = torch.arange(self.S, device=tokens.device)
        mask = torch.where(live[..., None], cols <= r[..., None], cols == self.S - 1)[:, None]  # (B, 1, R, S)
        nxt = self.tokens.gather(1, (r + 1).clamp(max=self.S - 1))
        logits, pre = self._run(self._hidden(r, from_target), nxt, r, slots, mask, last_only=True)
        self.pre[rows_idx, slots] = pre
        self.fed = torch.where(self.fed == self.rows, self.fed + (live & from_target).sum(1), self.fed)
        self.rows = self.rows + new
        return logits

    def rollback(self, drop: Tensor) -> None:
        self.lengths = self.lengths - drop
        self.rows = self.fed = torch.minimum(self.fed, (self.lengths - 1).clamp_min(0))

    def tree_forward(self, tokens: Tensor, positions: Tensor, seen: Tensor) -> Tensor:
        """Tree nodes (B, T) at token positions (B, T); seen (B, T, W + T) flags their segment ancestors and self.

        A node's row takes its parent's pre-norm output (the newest ancestor: parents are forwarded first; the root
        is the last fed token, row rows - 1) and sits in the slots after the row's committed rows."""
        B, T = tokens.shape
        W, dev = self.segment, tokens.device
        H = self.pre.shape[-1]
        hidden = self.pre.gather(1, (self.rows - 1).clamp_min(0)[:, None, None].expand(B, T, H))  # the root's
        if W:
            parent = (seen[..., :W] * torch.arange(1, W + 1, device=dev)).max(-1).values - 1  # (B, T), -1: root
            own = self.seg_pre.gather(1, parent.clamp_min(0)[..., None].expand(B, T, H))
            hidden = torch.where((parent >= 0)[..., None], own, hidden)
        slots = self.rows[:, None] + W + torch.arange(T, device=dev)
        rel = torch.arange(self.S, device=dev) - self.rows[:, None]  # (B, S) segment column of each slot
        seen_slot = seen.gather(2, rel.clamp(0, W + T - 1)[:, None, :].expand(B, T, self.S))
        mask = (rel < 0)[:, None] | ((rel >= 0) & (rel < W + T))[:, None] & seen_slot  # (B, T, S)
        logits, pre = self._run(hidden, tokens, positions - 1, slots, mask[:, None], last_only=False)
        self.seg_pre = torch.cat([self.seg_pre, pre], 1) if W else pre
        self.seg_tokens = torch.cat([self.seg_tokens, tokens], 1) if W else tokens
        self.segment = W + T
        return logits

    def tree_commit(self, cols: Tensor, counts: Tensor) -> None:
        """The path's tokens join the fed tokens; its rows (fed the head's own states) are dropped with the segment."""
        if self.segment:
            K, rows_idx = cols.shape[1], torch.arange(cols.shape[0], device=cols.device)[:, None]
            steps = torch.arange(K, device=cols.device)
            dst = torch.where(steps < counts[:, None], self.lengths[:, None] + steps, self.S - 1)
            self.tokens[rows_idx, dst] = self.seg_tokens.gather(1, cols.clamp_min(0))
            self.lengths = self.lengths + counts
        self.segment = 0

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.lengths.device)
        self.k, self.v, self.pre, self.tokens = self.k[index], self.v[index], self.pre[index], self.tokens[index]
        self.lengths, self.rows, self.fed = self.lengths[index], self.rows[index], self.fed[index]


def eagle3_states(
    target: nn.Module, draft: Eagle3Draft, batch_size: int, max_len: int
) -> tuple[AuxTargetState, Eagle3State]:
    """The two states of a generate call with an EAGLE-3 draft (max_len: positions a row may reach, slack included)."""
    aux = draft.aux_layers(target.config.num_hidden_layers)
    target_state = AuxTargetState(make_state(target, batch_size, max_len), aux, max_len)
    return target_state, Eagle3State(draft, target_state, embedding(target), batch_size, max_len)
