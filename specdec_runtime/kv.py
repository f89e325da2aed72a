"""KV-cache state of one model over a ragged batch: feed new tokens, roll back rejected ones.

The engine talks to a model only through a state object with these methods:
  extend(tokens (B, T), counts (B,), last_only, new_rows) -> logits (B, T or 1, V): row b's real tokens are its last
      counts[b] columns (holes on the left), at the positions that follow the row's cached tokens; new_rows, for a
      draft whose rows lag its tokens (the EAGLE-3 head's, eagle3_state.py), is the most rows any batch row computes
      in the call, which the engine knows on the host; the other states ignore it (their rows are the tokens);
  draft_step(x (B,)) -> logits (B, V): a chain's drafting step, each row fed its drafted token (an extend of one
      token with new_rows 1; the EAGLE-3 head's replays as one CUDA graph, eagle3_state.HeadCache);
  rollback(drop (B,)): forget each row's last drop[b] real tokens;
  tree_forward(tokens (B, T), positions (B, T), seen (B, T, W + T)) -> logits (B, T, V): token-tree nodes appended to
      an uncommitted segment of W columns after the row's real tokens; each sees those real tokens and the segment
      columns flagged in `seen` (its ancestors and itself);
  tree_commit(cols (B, K), counts (B,)): keep each row's first counts[b] segment columns listed in cols (the accepted
      path, in order) right after its real tokens, and drop the rest of the segment;
  select(keep: list of row indices): keep only those rows, in that order (finished rows leave the batch).
`HFState` serves any HF causal LM (or anything with the same forward keywords, `config.vocab_size`,
`config.max_position_embeddings` and `device`); `llama.StaticState` serves the compact model's per-row static cache.
"""

import functools
import inspect

import torch
from transformers import DynamicCache

from .llama import Llama, StaticState


def hf_forward(
    model: torch.nn.Module,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """Run `model` over new tokens (B, T) at explicit positions (B, T) against `cache` -> fp32 logits (B, T', V).

    attention_mask is 2D (B, S + T) over cache columns then new columns, or 4D (B, 1, T, S + T) for patterns a 2D
    mask cannot express (token trees: each node sees the prefix and its ancestors). The cache grows by T columns.
    """
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **{cache_keyword(type(model)): cache},
    )
    return out.logits.float()


@functools.cache
def cache_keyword(model_cls: type) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); an older model would silently ignore `cache=`."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def hole_layout(counts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of `width` new columns are real (right-aligned, holes left) and their positions -> (B, T) bool, (B, T)."""
    valid = torch.arange(width, device=counts.device) >= (width - counts)[:, None]  # (B, T)
    positions = (lengths[:, None] + valid.long().cumsum(1) - 1).clamp_min(0)  # holes reuse a harmless position
    return valid, positions


def drop_last_real(mask: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Real-column mask (B, S) without each row's last drop[b] real columns."""
    real_after = mask.flip(1).long().cumsum(1).flip(1)  # (B, S): real tokens at or after each column
    return mask & (real_after > drop[:, None])


class HFState:
    """Dynamic cache shared by all rows column-wise; holes (padding, rejected drafts) are masked out per row.

    After every rollback, commit and select each row's real columns sit right-aligned (holes only on the left) and the
    cache is exactly as wide as the longest row: rejected columns never pile up, whatever the other rows accept.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int):
        self.model = model
        self.cache = DynamicCache()  # no config: plain full-attention layers, croppable at any length
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=model.device)  # (B, S) real columns
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=model.device)  # (B,) real tokens = next pos
        self.segment = 0  # uncommitted tree columns after the mask's columns

    def extend(
        self, tokens: torch.Tensor, counts: torch.Tensor, last_only: bool = False, new_rows: int | None = None
    ) -> torch.Tensor:
        valid, positions = hole_layout(counts, self.lengths, tokens.shape[1])
        self.mask = torch.cat([self.mask, valid], 1)  # (B, S + T)
        self.lengths = self.lengths + counts
        return hf_forward(self.model, self.cache, tokens, positions, self.mask.long(), int(last_only))

    def draft_step(self, x: torch.Tensor) -> torch.Tensor:
        """The chain's drafting step: feed each row its drafted token x (B,) -> next draft logits (B, V)."""
        return self.extend(x[:, None], torch.ones_like(x), last_only=True, new_rows=1)[:, -1]

    def rollback(self, drop: torch.Tensor) -> None:
        self.mask = drop_last_real(self.mask, drop)
        self.lengths = self.lengths - drop
        self._compact()

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        self._compact()  # the rows that left may have been the longest

    def _compact(self) -> None:
        """Right-align each row's real columns (a stable move, so their order stays) and cut the unused left ones."""
        S = self.mask.shape[1]
        real = self.mask.sum(1)  # (B,)
        aligned = torch.arange(S, device=real.device) >= (S - real)[:, None]  # (B, S) the compact layout
        width, ragged = torch.stack([real.max(), (aligned != self.mask).any()]).tolist()  # one host sync
        if ragged:
            order = self.mask.long().argsort(dim=1, stable=True)  # (B, S) holes first, then real columns in order
            self._map_columns(lambda kv: kv.gather(2, order[:, None, :, None].expand_as(kv)))
            self.mask = aligned
        if width < S:
            self._map_columns(lambda kv: kv[:, :, S - width :])
            self.mask = self.mask[:, S - width :]

    def _map_columns(self, fn) -> None:
        """Apply fn to every layer's keys and values (B, H, S, D)."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        visible = torch.cat([self.mask[:, None, :].expand(B, T, -1), seen], -1)[:, None]  # (B, 1, T, S + W + T)
        # Additive 0 / min mask: eager attention adds the mask to the scores, SDPA accepts it too.
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=tokens.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        self.segment += T
        return hf_forward(self.model, self.cache, tokens, positions, mask)

    def tree_commit(self, cols: torch.Tensor, counts: torch.Tensor) -> None:
        if self.segment == 0:  # nothing forwarded (a depth-1 tree's draft), so nothing to keep
            return
        S, K = self.mask.shape[1], cols.shape[1]
        index = (S + cols.clamp_min(0))[:, None, :, None]  # (B, 1, K, 1) cache columns to keep, in path order
        for layer in self.cache.layers:
            gather = index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = torch.cat([layer.keys[:, :, :S], layer.keys.gather(2, gather)], 2)
            layer.values = torch.cat([layer.values[:, :, :S], layer.values.gather(2, gather)], 2)
        self.mask = torch.cat([self.mask, torch.arange(K, device=cols.device) < counts[:, None]], 1)
        self.lengths = self.lengths + counts
        self.segment = 0
        self._compact()  # rows that kept fewer path columns than others have holes at their end


def make_state(model: torch.nn.Module, batch_size: int, max_len: int) -> "HFState | StaticState":
    """Cache state for a model: the compact model's static per-row cache, else a dynamic HF cache."""
    if isinstance(model, Llama):
        return StaticState(model, batch_size, max_len)
    return HFState(model, batch_size)
