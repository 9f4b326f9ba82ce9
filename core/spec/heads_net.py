"""The draft heads as a network (Medusa-style): K small heads on the model's last hidden state,
head k guessing the token k+2 places ahead (the model's own output layer already predicts the
next one).

A head is one residual SiLU block over the hidden state h_i of the row that chose the pending
token and that token's embedding e (known when drafting, unlike the tokens after it: Medusa's
heads see h_i only; e raises the heads' held-out accuracy): h' = h + silu(W h + U e + b), read
out through the model's own output layer restricted to a draft vocabulary (the tokens that carry
nearly all of the model's probability on the training text; `brisk distill` picks it). The heads
own only W, U, b and that list of token ids: a few MB. W and U start at zero, so an untrained
head repeats the model's next-token guess, and training only has to learn the shift.
"""
from __future__ import annotations

import torch
from torch import nn


class DraftHeads(nn.Module):
    """K residual SiLU blocks over a hidden state h_i and the embedding e of the token after it
    (the pending token, known when drafting), as stacked weights (one batched matmul for all
    heads). forward(h [..., dim], e [..., dim]) -> [K, ..., dim], what each head reads out."""

    def __init__(self, n_heads: int, dim: int):
        super().__init__()
        # zero: a new head is the model's own next-token guess, and learns the shift from there
        self.weight = nn.Parameter(torch.zeros(n_heads, dim, dim))
        self.token_weight = nn.Parameter(torch.zeros(n_heads, dim, dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, dim))

    @property
    def n_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        flat, fe = h.reshape(-1, h.shape[-1]), e.reshape(-1, e.shape[-1])
        z = (torch.einsum("nd,ked->kne", flat, self.weight) + torch.einsum("nd,ked->kne", fe, self.token_weight)
             + self.bias[:, None])
        out = flat + torch.nn.functional.silu(z)
        return out.reshape(self.n_heads, *h.shape)


def output_rows(model, vocab: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The model's output-layer rows for `vocab` [n] as a float tensor [n, dim], whatever the layer's
    format (a quantized layer dequantizes just those rows)."""
    head = model.lm_head
    ids = vocab.to(model.model.norm.weight.device)
    if hasattr(head, "rows"):  # QuantLinear (GGUF blocks, int4/int8, GPTQ, ...)
        return head.rows(ids, dtype)
    return head.weight.index_select(0, ids).to(dtype)


def head_logits(heads: DraftHeads, rows: torch.Tensor, h: torch.Tensor, e: torch.Tensor,
                softcap: float | None) -> torch.Tensor:
    """Logits [K, ..., n] over the draft vocabulary for hidden states h [..., dim] and the next
    tokens' embeddings e [..., dim]."""
    logits = heads(h, e) @ rows.T
    if softcap:  # as the model's own head does (Gemma): training and drafting see the same logits
        logits = torch.tanh(logits / softcap) * softcap
    return logits
