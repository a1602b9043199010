"""The training loss: each token's next-token NLL, weighted (text 1, answers `answer_weight`, padding 0).

`weighted_loss` takes logits, as a forward returns them. `unembedded_loss` takes the final normalised
residual stream h [tokens, d_model] and the unembedding W [vocab, d_model] and gives the same loss without
ever holding the [tokens, vocab] logits whole: a block of rows at a time it forms z = h W^T, the NLL
lse(z) - z_y, and, the loss being the graph's end, its gradient there and then,

  dL/dz = (softmax(z) - onehot(y)) w / sum(w),   dL/dh = (dL/dz) W,   dL/dW = sum over blocks (dL/dz)^T h

so backward only scales them by the incoming gradient. The matmuls are those of the plain path; what
goes is the traffic of logits, softmax and their gradient at the full [tokens, vocab] size (a batch of
16 x 2,048 tokens and 4,096 token ids: 512 MiB each). Under autocast (`optim.precision` "bfloat16") the
three products take their operands in bfloat16, as autocast's own matmuls would; lse, softmax and the
sums stay in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def answer_mean(nll: Tensor, w: Tensor) -> Tensor:
    """Mean NLL on answer tokens (weight above 1), or on every weighted token when a batch has none."""
    answer = w > 1.0 if bool((w > 1.0).any()) else w > 0
    return nll[answer].mean()


def weighted_loss(logits: Tensor, tokens: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(weighted mean NLL, mean NLL on answer tokens) predicting tokens[t] at t-1."""
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none").view_as(
        tokens[:, 1:]
    )
    w = weights[:, 1:]
    loss = (nll * w).sum() / w.sum().clamp_min(1e-8)
    return loss, answer_mean(nll, w)


class UnembeddedNLL(torch.autograd.Function):
    """sum_i w_i NLL_i / sum(w) of logits h W^T, `rows` rows at a time (module docstring); also
    returns every row's NLL, without a gradient."""

    @staticmethod
    def forward(
        ctx, h: Tensor, W: Tensor, targets: Tensor, w: Tensor, rows: int, low: torch.dtype | None
    ) -> tuple[Tensor, Tensor]:
        work = torch.promote_types(h.dtype, torch.float32)
        low = low or work  # the products' operands' dtype
        hl, Wl = h.to(low), W.to(low)
        scale = w.to(work) / w.sum().to(work).clamp_min(1e-8)
        nll = torch.empty(h.shape[0], dtype=work, device=h.device)
        grad_h, grad_W = (
            torch.empty_like(h, dtype=work),
            torch.zeros_like(W, dtype=work) if ctx.needs_input_grad[1] else None,
        )
        for start in range(0, h.shape[0], rows):
            block = slice(start, start + rows)
            z = (hl[block] @ Wl.T).to(work)
            y = targets[block, None]
            lse = torch.logsumexp(z, -1, keepdim=True)
            nll[block] = (lse - z.gather(1, y))[:, 0]
            z.sub_(lse).exp_()  # softmax, in place
            z.scatter_add_(1, y, torch.full_like(y, -1, dtype=work))
            z.mul_(scale[block, None])
            zl = z.to(low)
            grad_h[block] = zl @ Wl
            if grad_W is not None:  # not for a frozen unembedding (LongMem's backbone)
                grad_W.add_(zl.T @ hl[block])
        ctx.save_for_backward(grad_h.to(h.dtype), None if grad_W is None else grad_W.to(W.dtype))
        ctx.mark_non_differentiable(nll)
        return (nll * scale).sum(), nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        grad_h, grad_W = ctx.saved_tensors
        return grad_h * grad_loss, None if grad_W is None else grad_W * grad_loss, None, None, None, None


def unembedded_loss(h: Tensor, W: Tensor, tokens: Tensor, weights: Tensor, rows: int = 1024) -> tuple[Tensor, Tensor]:
    """`weighted_loss` of the logits h W^T (h [B, T, d_model] the final normalised residual stream,
    W [vocab, d_model] the unembedding), `rows` tokens at a time."""
    w = weights[:, 1:].flatten()
    device = h.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device, enabled=False):  # the products' dtype is `low`, the rest float32
        loss, nll = UnembeddedNLL.apply(h[:, :-1].flatten(0, 1), W, tokens[:, 1:].flatten(), w, rows, low)
    return loss, answer_mean(nll, w)
