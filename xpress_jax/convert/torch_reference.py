"""The reference head's math in plain PyTorch, on SOURCE tensors (HYBRID_KEY_MAP names, raw mixer).

An eager port of vLLM's ``XPressRefinerHead`` for checking conversions (docs/semantics.md):
``Lf = raw * tril + I`` folded in the raw tensor's dtype, then every weight cast to ``dtype``;
``hcache = cat(down_h(h), down_g(mean_slots(h)))``; per pass ``x = in_proj(cat(hcache, w1[prev]))``,
the causal mix by ``Lf`` and ``lat = x + mlp(x)``. The seed block is the base argmax; full vocabulary
picks ``argmax(base + w2(lat))`` (first index on ties); top-C keeps each slot's C largest base logits
once per call (a stable descending sort, as ``torch.topk(sorted=True)``) and picks the first candidate
position with the largest ``base_c + w2[cand] @ lat``. NaN scores count as -inf. A reduced draft vocabulary
(``d2t`` among the tensors; ``w2`` and the logits [.., V_draft]): every pick is a draft id, mapped to the
verifier's as ``id + d2t[id]`` (speculators' ``_draft_to_verifier_ids``). Needs torch.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_dtypes
import numpy as np

__all__ = ["to_torch", "reference_refine"]


def to_torch(a: Any):
    """A torch tensor from numpy (ml_dtypes bfloat16 included) or torch input."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def _clean(s):
    import torch

    return torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)


def reference_refine(tensors: Mapping[str, Any], logits: Any, h: Any, anchors: Any, tok_am1: Any = None, *,
                     num_passes: int, topc: int = 0, dtype: Any = None) -> np.ndarray:
    """Draft tokens [N, B-1] (int64 numpy) of the reference head on the source ``tensors``.

    ``logits`` [N, B, V] ([N, B, V_draft] with ``d2t``) and ``h`` [N, B, H] are cast to ``dtype`` (default
    torch.float64); ``tok_am1`` (the token before each anchor) defaults to ``anchors`` (what vLLM passes).
    """
    import torch
    import torch.nn.functional as F

    dtype = torch.float64 if dtype is None else dtype
    T = {k: to_torch(v) for k, v in tensors.items() if k != "t2d"}
    d2t = T.pop("d2t").to(torch.long) if "d2t" in T else None

    def to_verifier(ids):
        return ids if d2t is None else ids + d2t[ids]

    raw = T["mix.L"]
    r, B, _ = raw.shape
    tril = torch.tril(torch.ones(B, B, dtype=raw.dtype))
    eye = torch.eye(B, dtype=raw.dtype)
    Lf = (raw * tril + eye).to(dtype)  # fold_from_raw_, in the checkpoint's dtype
    W = {k: v.to(dtype) for k, v in T.items() if k != "mix.L"}
    w1, w2 = W["w1.weight"], W["w2.weight"]

    base_full = to_torch(logits).to(dtype)
    h = to_torch(h).to(dtype)
    anchors = to_torch(anchors).to(torch.long)
    tok_am1 = anchors if tok_am1 is None else to_torch(tok_am1).to(torch.long)
    N, B_, V = base_full.shape
    if B_ != B:
        raise ValueError(f"logits block size {B_} != mixer block size {B}")

    with torch.no_grad():
        g = h.mean(dim=1, keepdim=True).expand_as(h)
        hcache = torch.cat([h @ W["down_h.weight"].T, g @ W["down_g.weight"].T], dim=-1)

        rows = N * (B - 1)
        slots = _clean(base_full[:, 1:, :]).reshape(rows, V)
        blk = torch.empty(N, B, dtype=torch.long)
        blk[:, 0] = anchors
        blk[:, 1:] = to_verifier(slots.argmax(dim=-1)).view(N, B - 1)
        if topc:
            c = min(topc, V)
            order = torch.sort(slots, dim=-1, descending=True, stable=True).indices[:, :c]
            cand, base_c = order, torch.gather(slots, 1, order)
            w2c = w2[cand]  # [rows, c, r]

        for _ in range(num_passes):
            prev = torch.cat([tok_am1[:, None], blk[:, :-1]], dim=1)
            x = torch.cat([hcache, w1[prev]], dim=-1) @ W["in_proj.weight"].T
            x = torch.bmm(Lf, x.permute(2, 1, 0)).permute(2, 1, 0)
            lat = x + (F.silu(x @ W["mlp.gate_proj.weight"].T) * (x @ W["mlp.up_proj.weight"].T)) @ W[
                "mlp.down_proj.weight"
            ].T
            lat = lat[:, 1:, :].reshape(rows, r)
            if topc:
                bias_c = torch.bmm(w2c, lat.reshape(rows, r, 1)).view(rows, c)
                s = _clean(base_c + bias_c)
                pick = torch.gather(cand, 1, s.argmax(dim=-1, keepdim=True))[:, 0]  # first position
            else:
                s = _clean(slots + lat @ w2.T)
                pick = s.argmax(dim=-1)
            blk[:, 1:] = to_verifier(pick).view(N, B - 1)
    return blk[:, 1:].numpy()
