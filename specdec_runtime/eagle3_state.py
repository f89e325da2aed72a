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
from .llama import Llama, StaticState, graph_rows

__all__ = ["AuxCapture", "AuxTargetState", "Eagle3State", "HeadCache", "eagle3_states"]


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


class HeadCache:
    """The head's per-row buffers and its drafting step's CUDA graphs, kept on the head across generate calls as the
    compact target keeps its static cache: a graph records addresses, so every update is in place (finished rows
    leave by moving the kept rows to the front) and a later call replays the graphs an earlier one captured.

    Slot r of a row holds row r (keys, values, pre-norm output), `tokens` the token at each position; the last slot
    is the trash slot of holes. lengths / rows / fed: tokens fed, rows computed, rows computed from target features.
    """

    def __init__(self, draft: Eagle3Draft, embed: nn.Embedding, rows: int, S: int):
        cfg, dtype, dev = draft.config, draft.compute_dtype, draft.norm.weight.device
        # a weak reference: the head holds its cache (`head_cache`), and a strong one back would keep the buffers and
        # the graph pool alive after the head is deleted, until a full garbage collection
        self._draft, self.embed, self.S = weakref.ref(draft), embed, S
        self.k = torch.zeros(rows, S, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.pre = torch.zeros(rows, S, cfg.hidden_size, dtype=dtype, device=dev)  # (rows, S, H) pre-norm outputs
        self.tokens = torch.zeros(rows, S, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.rows, self.fed = torch.zeros_like(self.lengths), torch.zeros_like(self.lengths)
        self.graphs: dict[int, tuple] = {}  # graph rows (`llama.graph_rows`) -> (replay, x, logits)
        self.pool = None

    @classmethod
    def for_call(cls, draft: Eagle3Draft, embed: nn.Embedding, batch_size: int, max_len: int) -> "HeadCache":
        """The head's cache, kept when it fits this call (rows, positions, dtype, device, the target's embedding),
        else a new one (dropping the old graphs with it); its first batch_size rows start empty."""
        cache, dev = draft.head_cache, draft.norm.weight.device
        fits = (
            cache is not None
            and cache.embed is embed
            and cache.k.shape[0] >= batch_size
            and cache.S > max_len
            and cache.k.dtype == draft.compute_dtype
            and cache.k.device == dev
        )
        if not fits:
            cache = draft.head_cache = None  # free the old buffers first
            S = -(-(max_len + 1) // 16) * 16  # rounded, as the target's, so similar lengths reuse it
            cache = draft.head_cache = cls(draft, embed, batch_size, S)
        for t in (cache.lengths, cache.rows, cache.fed):
            t[:batch_size].zero_()
        return cache

    @property
    def draft(self) -> Eagle3Draft:
        return self._draft()

    def buffers(self) -> tuple[Tensor, ...]:
        return self.k, self.v, self.pre, self.tokens, self.lengths, self.rows, self.fed

    def bookkeeping(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.lengths, self.rows, self.fed

    def graphed(self) -> bool:
        return self.k.device.type == "cuda" and self.draft.use_graphs

    # ------------------------------------------------------------------------------------------------ one forward

    def advance(self, B: int, tokens: Tensor, counts: Tensor, R: int, target=None) -> Tensor:
        """Feed rows 0..B-1 tokens (B, T) (counts real, right-aligned) and compute up to R new rows each -> the
        last row's target-id logits (B, 1, V) fp32.

        A new row r pairs the hidden state of position r with the embedding of token r + 1: the target's feature
        through fc when `target` (AuxTargetState) has scored r, else row r - 1's pre-norm output. target=None: a
        drafting step, whose rows the target has never scored (the drafted tokens lie past its verified ones), so
        the step reads nothing of the target's and a CUDA graph of it replays in any call."""
        S, dev = self.S, tokens.device
        T = tokens.shape[1]
        lengths, done, fed = self.lengths[:B], self.rows[:B], self.fed[:B]
        valid, positions = hole_layout(counts, lengths, T)
        row_ids = torch.arange(B, device=dev)[:, None]
        self.tokens[row_ids, torch.where(valid, positions, S - 1)] = tokens
        lengths.add_(counts)
        new = (lengths - 1 - done).clamp_min(0)  # (B,) rows to compute: rows .. lengths - 2
        if R == 0:  # one-token prompts at prefill: no row has a next token yet
            return torch.zeros(B, 1, self.draft.target_vocab, device=dev)
        live, r = hole_layout(new, done, R)  # (B, R) right-aligned rows; rows with fewer are padded on the left
        own = self.pre[:B].gather(1, (r - 1).clamp_min(0)[..., None].expand(-1, -1, self.pre.shape[-1]))
        from_target = r < target.lengths[:, None] if target is not None else torch.zeros_like(live)
        hidden = own if target is None else self._hidden(r, from_target, own, target)
        slots = torch.where(live, r, S - 1)
        cols = torch.arange(S, device=dev)
        mask = torch.where(live[..., None], cols <= r[..., None], cols == S - 1)[:, None]  # (B, 1, R, S)
        nxt = self.tokens[:B].gather(1, (r + 1).clamp(max=S - 1))
        embeds = self.embed(nxt).to(hidden.dtype)
        logits, pre = self.draft(hidden, embeds, r, SlotCache(self.k, self.v, slots), mask, last_only=True)
        # A bf16 `cpu_eagle3` copy keeps its norms fp32, so a state that passed one (norm_before_residual,
        # norm_output) comes out fp32; the cache holds the head's compute dtype.
        self.pre[row_ids, slots] = pre.to(self.pre.dtype)
        fed.copy_(torch.where(fed == done, fed + (live & from_target).sum(1), fed))
        done.add_(new)
        return to_target_logits(logits.float(), self.draft.d2t, self.draft.target_vocab)

    def _hidden(self, r: Tensor, from_target: Tensor, own: Tensor, target) -> Tensor:
        """Rows r (B, R) -> hidden states (B, R, H): fc(target features of r) where the target scored r, else own."""
        # Skipping fc (3H -> H) where no row needs it takes a host read, free on the CPU only (CUDA computes fc
        # rather than wait for the device).
        if reads_are_free(r.device) and not bool(from_target.any()):
            return own
        features = target.features(r).to(self.draft.compute_dtype)
        return torch.where(from_target[..., None], self.draft.fc(features), own)

    # ----------------------------------------------------------------------------------- the drafting step, graphed

    def draft_step(self, B: int, x: Tensor) -> Tensor:
        """Feed each of rows 0..B-1 its drafted token x (B,) -> the next draft logits (B, V) fp32; on CUDA one graph
        replay per call (60-80 kernel launches otherwise), its rows a power of two with padding rows past B."""
        if not self.graphed():
            return self.advance(B, x[:, None], torch.ones_like(x), 1)[:, -1]
        rows = graph_rows(B, self.k.shape[0])
        if rows not in self.graphs:
            self.graphs[rows] = self._capture(rows)
        replay, x_in, logits = self.graphs[rows]
        x_in[:B], x_in[B:] = x, 0
        for t in self.bookkeeping():
            t[B:rows] = 0  # padding rows (no row in this call) feed position 0 and compute nothing: trash slot only
        replay()
        return logits[:B].clone()  # the graph's buffer: the next replay overwrites it

    def capture_graphs(self, max_rows: int) -> None:
        """Capture now the drafting step's graph for every row count a batch of up to max_rows rows replays, so that
        none is captured inside a timed call; a no-op off CUDA or without graphs."""
        if self.graphed():
            for rows in sorted({graph_rows(b, self.k.shape[0]) for b in range(1, max_rows + 1)}):
                if rows not in self.graphs:
                    self.graphs[rows] = self._capture(rows)

    @torch.no_grad()  # a graph captured with autograd on records a backward graph, its saved tensors in the pool
    def _capture(self, rows: int) -> tuple:
        """The drafting step of `rows` rows as a graph -> (replay, its input x (rows,), its logits (rows, V)).

        Safe inside a call: the warm-up runs as padding rows (empty bookkeeping), which write a token at position 0
        and keys, values and pre-norm outputs at the trash slot only; what they change of the live rows is put back.
        """
        x = torch.zeros(rows, dtype=torch.long, device=self.k.device)
        kept = [t[:rows].clone() for t in self.bookkeeping()] + [self.tokens[:rows, 0].clone()]

        def as_padding() -> None:
            for t in self.bookkeeping():
                t[:rows] = 0

        step = partial(self.advance, rows, x[:, None], torch.ones_like(x), 1)
        replay, logits = self._record(lambda: step()[:, -1], as_padding)
        for t, old in zip([*self.bookkeeping(), self.tokens[:, 0]], kept):
            t[:rows] = old
        return replay, x, logits

    def _record(self, step, reset) -> tuple:
        """Warm `step` up on a side stream (each run after `reset`), then capture it in the pool the head's graphs
        share -> (replay, its output)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                reset()
                step()
        torch.cuda.current_stream().wait_stream(side)
        reset()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph.replay, out


class Eagle3State:
    """The head's state over a ragged batch, fed by the engine like any draft (module docstring): rows 0..B-1 of the
    head's cache (`HeadCache`), B shrinking as finished rows leave."""

    def __init__(self, draft: Eagle3Draft, target: AuxTargetState, embed: nn.Embedding, batch_size: int, max_len: int):
        self.model, self.target = draft, target
        self.cache = HeadCache.for_call(draft, embed, batch_size, max_len)
        self.B = batch_size
        self.segment = 0  # uncommitted tree rows, in the slots after each row's `rows`
        self.seg_pre, self.seg_tokens = self.cache.pre[:batch_size, :0], self.cache.tokens[:batch_size, :0]

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens fed: the engine's view. A view of the cache: updated in place, never reassigned."""
        return self.cache.lengths[: self.B]

    def extend(self, tokens: Tensor, counts: Tensor, last_only: bool = False, new_rows: int | None = None) -> Tensor:
        """new_rows: R, the most rows any batch row computes (kv.py), from the engine: reading it off the device
        would cost a host sync per draft forward."""
        if not last_only or new_rows is None:
            raise ValueError(
                "an EAGLE-3 draft state returns the last fed token's logits only (last_only=True) and takes the most "
                "rows a batch row computes from its caller (new_rows=R)"
            )
        return self.cache.advance(self.B, tokens, counts, new_rows, self.target)

    def draft_step(self, x: Tensor) -> Tensor:
        """The chain's drafting step: feed each row its drafted token x (B,) -> next draft logits (B, V)."""
        return self.cache.draft_step(self.B, x)

    def rollback(self, drop: Tensor) -> None:
        c, B = self.cache, self.B
        c.lengths[:B].sub_(drop)
        kept = torch.minimum(c.fed[:B], (c.lengths[:B] - 1).clamp_min(0))
        c.rows[:B].copy_(kept)
        c.fed[:B].copy_(kept)

    def tree_forward(self, tokens: Tensor, positions: Tensor, seen: Tensor) -> Tensor:
        """Tree nodes (B, T) at token positions (B, T); seen (B, T, W + T) flags their segment ancestors and self.

        A node's row takes its parent's pre-norm output (the newest ancestor: parents are forwarded first; the root
        is the last fed token, row rows - 1) and sits in the slots after the row's committed rows."""
        B, T = tokens.shape
        c, W, dev = self.cache, self.segment, tokens.device
        S, H, done = c.S, c.pre.shape[-1], c.rows[:B]
        hidden = c.pre[:B].gather(1, (done - 1).clamp_min(0)[:, None, None].expand(B, T, H))  # the root's
        if W:
            parent = (seen[..., :W] * torch.arange(1, W + 1, device=dev)).max(-1).values - 1  # (B, T), -1: root
            own = self.seg_pre.gather(1, parent.clamp_min(0)[..., None].expand(B, T, H))
            hidden = torch.where((parent >= 0)[..., None], own, hidden)
        slots = done[:, None] + W + torch.arange(T, device=dev)
        rel = torch.arange(S, device=dev) - done[:, None]  # (B, S) segment column of each slot
        seen_slot = seen.gather(2, rel.clamp(0, W + T - 1)[:, None, :].expand(B, T, S))
        mask = (rel < 0)[:, None] | ((rel >= 0) & (rel < W + T))[:, None] & seen_slot  # (B, T, S)
        embeds = c.embed(tokens).to(hidden.dtype)
        logits, pre = self.model(hidden, embeds, positions - 1, SlotCache(c.k, c.v, slots), mask[:, None])
        pre = pre.to(c.pre.dtype)  # as `HeadCache.advance` stores it
        self.seg_pre = torch.cat([self.seg_pre, pre], 1) if W else pre
        self.seg_tokens = torch.cat([self.seg_tokens, tokens], 1) if W else tokens
        self.segment = W + T
        return to_target_logits(logits.float(), self.model.d2t, self.model.target_vocab)

    def tree_commit(self, cols: Tensor, counts: Tensor) -> None:
        """The path's tokens join the fed tokens; its rows (fed the head's own states) are dropped with the segment."""
        if self.segment:
            c, B, K = self.cache, cols.shape[0], cols.shape[1]
            row_ids, steps = torch.arange(B, device=cols.device)[:, None], torch.arange(K, device=cols.device)
            dst = torch.where(steps < counts[:, None], c.lengths[:B, None] + steps, c.S - 1)
            c.tokens[row_ids, dst] = self.seg_tokens.gather(1, cols.clamp_min(0))
            c.lengths[:B].add_(counts)
        self.segment = 0

    def select(self, keep: list[int]) -> None:
        """Move the kept rows to the front of the head's cache, in place (its CUDA graphs hold the addresses)."""
        moved = [i for i, src in enumerate(keep) if i != src]  # keeping a prefix moves nothing
        if moved:
            dev = self.cache.lengths.device
            dst, src = torch.tensor(moved, device=dev), torch.tensor([keep[i] for i in moved], device=dev)
            for t in self.cache.buffers():
                t[dst] = t[src]  # the right side is gathered first: overlapping moves are safe
        self.B = len(keep)


def eagle3_states(
    target: nn.Module, draft: Eagle3Draft, batch_size: int, max_len: int
) -> tuple[AuxTargetState, Eagle3State]:
    """The two states of a generate call with an EAGLE-3 draft (max_len: positions a row may reach, slack included)."""
    aux = draft.aux_layers(target.config.num_hidden_layers)
    target_state = AuxTargetState(make_state(target, batch_size, max_len), aux, max_len)
    return target_state, Eagle3State(draft, target_state, embedding(target), batch_size, max_len)
