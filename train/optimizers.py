"""The optimizer of a distillation run (train.optimizer): AdamW, or Muon on the weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update (Newton-Schulz iterations) and is what the
speculators package's EAGLE-3 trainer uses by default; it takes matrices only, so norms, biases and the
embedding-like matrices (input embeddings, the output head), which Muon's authors leave to AdamW, stay with AdamW.
The two run as one `torch.optim.Optimizer` (`MuonAdamW`): one object for accelerate to wrap, the schedule to scale,
clipping to read and a checkpoint to hold, with both halves' state in it.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec_runtime.errors import UserError


def build_optimizer(student: nn.Module, train_cfg) -> torch.optim.Optimizer:
    """The optimizer train.optimizer names over the student's trainable parameters."""
    trainable = [p for p in student.parameters() if p.requires_grad]
    # On the CPU torch's default AdamW loops over the tensors (0.09 vs 0.03 s a step for the 4-layer SmolLM2
    # student, docs/benchmarks.md); on CUDA its default (foreach) is already multi-tensor.
    fused = True if all(p.device.type == "cpu" for p in trainable) else None
    adamw = dict(lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, fused=fused)
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(trainable, **adamw)
    matrices, rest = muon_split(student, trainable)
    muon = dict(lr=train_cfg.lr, weight_decay=train_cfg.muon_weight_decay)
    return MuonAdamW(matrices, rest, muon=muon, adamw=adamw)


def muon_split(student: nn.Module, trainable: list[nn.Parameter]) -> tuple[list, list]:
    """(Muon's parameters, AdamW's): the 2-D weights but those of embedding modules and the output head."""
    embedding_like = {id(p) for m in student.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = student.get_output_embeddings() if hasattr(student, "get_output_embeddings") else None
    head = head if head is not None else getattr(student, "lm_head", None)  # an EAGLE-3 head has no getter
    if head is not None:
        embedding_like |= {id(p) for p in head.parameters()}
    matrices = [p for p in trainable if p.ndim == 2 and id(p) not in embedding_like]
    rest = [p for p in trainable if p.ndim != 2 or id(p) in embedding_like]
    return matrices, rest


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `matrices` and torch.optim.AdamW over `rest`, as one optimizer.

    Its param_groups are Muon's groups then AdamW's (the same dicts the two step with, so a schedule that scales
    `lr` here scales both) and its state is theirs, so `state_dict` / `load_state_dict` carry both halves. Muon's
    learning rate is scaled to match AdamW's update size (`adjust_lr_fn="match_rms_adamw"`), so train.lr means the
    same for both halves, as in speculators' trainer.
    """

    def __init__(self, matrices: list, rest: list, *, muon: dict, adamw: dict):
        if not matrices:
            raise UserError("train.optimizer=muon found no 2-D weight matrix to train: use train.optimizer=adamw")
        self._muon = torch.optim.Muon(matrices, adjust_lr_fn="match_rms_adamw", **muon)
        self._adamw = torch.optim.AdamW(rest, **adamw) if rest else None
        groups = [*self._muon.param_groups, *(self._adamw.param_groups if self._adamw else [])]
        super().__init__(groups, defaults={})
        self._link()

    @property
    def halves(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers stepped inside `step` (a global step hook sees them step too)."""
        return (self._muon,) if self._adamw is None else (self._muon, self._adamw)

    def _link(self) -> None:
        """Point both halves at this optimizer's groups and state (again after load_state_dict replaced them)."""
        n = len(self._muon.param_groups)
        self._muon.param_groups, self._muon.state = self.param_groups[:n], self.state
        if self._adamw is not None:
            self._adamw.param_groups, self._adamw.state = self.param_groups[n:], self.state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_muon" in self.__dict__:
            self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss
