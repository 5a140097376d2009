"""The hybrid loss (docs/TRAINING.md, step 5 of the objective) and the module that computes it from a batch.

    L_AR  = mean cross-entropy over every clean-slot target of the micro-batch
    L_MDM = sum over masked tokens of CE * the mask weight of its sample (1 / (p_mask * response length) for
            slots, 1 / its number of masks for a draft-chain sample), divided by the number of samples
    loss  = L_AR + lambda * L_MDM

`HybridObjective` wraps the causal LM so that the distributed wrappers (DDP, FSDP, DeepSpeed) see one
module whose forward returns the loss; with `logits_on_labels` it applies the LM head only at labelled
positions (hidden states -> gather -> lm_head), which gives the same loss for less compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from refusion.train.noising import IGNORE_INDEX


@dataclass(frozen=True)
class LossParts:
    """The loss of one micro-batch and its parts (scalar tensors)."""

    loss: torch.Tensor
    """L_AR + lambda * L_MDM, the value that is back-propagated."""
    loss_ar: torch.Tensor
    """L_AR (0 when the micro-batch has no clean-slot target)."""
    loss_mdm: torch.Tensor
    """L_MDM (0 when the micro-batch has no masked token)."""
    num_ar: torch.Tensor
    """Number of clean-slot targets."""
    num_mdm: torch.Tensor
    """Number of masked tokens."""


def hybrid_loss(logits: torch.Tensor, targets: torch.Tensor, is_masked: torch.Tensor, mdm_token_weight: torch.Tensor,
                num_samples: int, *, mdm_weight: float = 1.0) -> LossParts:
    """Loss over N labelled positions: logits [N, V], targets [N], is_masked [N], mdm_token_weight [N]
    (the mask weight of each position's sample)."""
    ce = F.cross_entropy(logits.float(), targets, reduction="none")           # [N]
    is_ar = ~is_masked
    num_ar, num_mdm = is_ar.sum(), is_masked.sum()
    loss_ar = (ce * is_ar).sum() / num_ar.clamp(min=1)
    loss_mdm = (ce * mdm_token_weight * is_masked).sum() / max(num_samples, 1)
    return LossParts(loss_ar + mdm_weight * loss_mdm, loss_ar, loss_mdm, num_ar, num_mdm)


def select_labelled(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(selection [B, S] bool, targets [N], is_masked [N], mdm_token_weight [N]) of the labelled positions."""
    selection = batch["labels"] != IGNORE_INDEX
    token_weight = batch["mask_weight"][:, None].expand_as(selection)          # [B, S]
    return selection, batch["labels"][selection], batch["is_masked"][selection], token_weight[selection]


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning hidden states, LM head) of a transformers causal LM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is base or head is None:
        raise ValueError(f"{type(base).__name__} does not expose a decoder and an LM head; use logits_on_labels=False")
    return decoder, head


class HybridObjective(nn.Module):
    """A causal LM plus the hybrid loss: forward(batch) -> LossParts."""

    def __init__(self, model: nn.Module, *, mdm_weight: float = 1.0, logits_on_labels: bool = True):
        super().__init__()
        self.model = model
        self.mdm_weight = mdm_weight
        self.logits_on_labels = logits_on_labels
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # FSDP auto-wrap reads this

    def forward(self, batch: dict[str, torch.Tensor]) -> LossParts:
        selection, targets, is_masked, token_weight = select_labelled(batch)
        logits = self.labelled_logits(batch, selection)                         # [N, V]
        return hybrid_loss(logits, targets, is_masked, token_weight, batch["input_ids"].shape[0],
                           mdm_weight=self.mdm_weight)

    def labelled_logits(self, batch: dict[str, torch.Tensor], selection: torch.Tensor) -> torch.Tensor:
        # An explicit all-ones attention mask keeps transformers from reading the permuted position ids as
        # several packed sequences; right padding needs no mask under causal attention. Draft chains bring
        # their own [B, 1, S, S] mask (noising.chain_attention).
        mask = batch.get("attention_mask")
        inputs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=torch.ones_like(batch["input_ids"]) if mask is None else mask, use_cache=False)
        if not self.logits_on_labels:
            return self.model(**inputs).logits[selection]
        decoder, head = causal_lm_parts(self.model)
        hidden = decoder(**inputs).last_hidden_state                            # [B, S, H]
        logits = head(hidden[selection])                                        # [N, V]
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap
