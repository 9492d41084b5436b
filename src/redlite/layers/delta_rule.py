"""Pure PyTorch kernels of the gated delta rule (single sequence, no batch dimension).

The gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", 2024, eq. 10) keeps, per value head, a matrix state ``S`` of shape
``[d_k, d_v]`` and updates it once per token ``t``::

    S_t = a_t * S_{t-1} + k_t (beta_t * (v_t - a_t * S_{t-1}^T k_t))^T
    o_t = S_t^T q_t

with the decay ``a_t = exp(g_t)`` (``g_t <= 0``, log space) and the writing strength
``beta_t`` in ``(0, 1)``. ``q`` and ``k`` arrive already L2-normalised and ``q`` already
multiplied by ``d_k ** -0.5`` (the layer in :mod:`redlite.layers.gated_deltanet` does that).

Two equivalent evaluation orders are provided:

* :func:`recurrent_gated_delta_rule` walks the tokens one by one (decode, O(1) per token);
* :func:`chunk_gated_delta_rule` processes chunks of ``chunk_size`` tokens with the WY/UT
  representation of the paper's section 3.3 (prefill): inside a chunk everything is a few
  matmuls plus one unit-lower-triangular solve; only the chunk-to-chunk state hand-over is
  sequential.

Both take and return the state, so a sequence can be fed in any number of pieces; the
result depends on the split only through float rounding.

Shapes (``T`` tokens, ``Hk`` key heads, ``Hv`` value heads, ``Hv % Hk == 0``; each key head
serves ``Hv // Hk`` consecutive value heads, as in the Qwen3.5 checkpoints):

* ``q``, ``k``: ``[T, Hk, Dk]``; ``v``: ``[T, Hv, Dv]``; ``g``, ``beta``: ``[T, Hv]``;
* ``state``: ``[Hv, Dk, Dv]``, float32;
* output ``o``: ``[T, Hv, Dv]``, float32.

All arithmetic is float32 whatever the input dtype (the state accumulates over the whole
conversation; bf16 there drifts).
"""

from __future__ import annotations

import torch

__all__ = [
    "l2_normalize",
    "expand_key_heads",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "DEFAULT_CHUNK_SIZE",
]

DEFAULT_CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` over the last dimension, computed in float32.

    Same formula (eps inside the square root) as flash-linear-attention's ``l2norm`` and the
    transformers Qwen3.5 reference, so the torch path matches the CUDA kernels.
    Returns float32, same shape as ``x``.
    """
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_key_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """Repeat key heads (dim 1 of ``[T, Hk, D]``) so there is one per value head.

    Key head ``h`` serves value heads ``h * r .. h * r + r - 1`` with ``r = Hv // Hk``
    (``repeat_interleave``, the Qwen3.5 grouping). Raises ValueError when ``Hv % Hk != 0``.
    """
    num_key_heads = x.shape[1]
    if num_value_heads == num_key_heads:
        return x
    if num_value_heads % num_key_heads:
        raise ValueError(f"value heads ({num_value_heads}) not a multiple of key heads ({num_key_heads})")
    return x.repeat_interleave(num_value_heads // num_key_heads, dim=1)


def _to_head_major(q, k, v, g, beta):
    """Float32, heads first: q/k ``[Hv, T, Dk]``, v ``[Hv, T, Dv]``, g/beta ``[Hv, T]``."""
    hv = v.shape[1]
    q = expand_key_heads(q, hv).float().transpose(0, 1)
    k = expand_key_heads(k, hv).float().transpose(0, 1)
    v = v.float().transpose(0, 1)
    g = g.float().transpose(0, 1)
    beta = beta.float().transpose(0, 1)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (see the module docstring for shapes).

    Returns ``(o, new_state)``: ``o`` float32 ``[T, Hv, Dv]``, ``new_state`` a new float32
    tensor ``[Hv, Dk, Dv]`` (``state`` itself is not modified). Cost O(T * Hv * Dk * Dv);
    meant for decode (T == 1) and short feeds.
    """
    q, k, v, g, beta = _to_head_major(q, k, v, g, beta)
    s = state.float()
    outputs = []
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        k_t = k[:, t]  # [Hv, Dk]
        predicted = torch.einsum("hkv,hk->hv", s, k_t)
        delta = (v[:, t] - predicted) * beta[:, t, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", s, q[:, t]))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o.transpose(0, 1).contiguous(), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY representation) gated delta rule (see the module docstring for shapes).

    Mathematically equal to :func:`recurrent_gated_delta_rule`. Within a chunk, with
    ``c_t`` the cumulative log decay from the chunk start to ``t`` (inclusive) and ``S0``
    the state entering the chunk, unrolling the recurrence gives pseudo-values
    ``u = T (beta*v) - T (beta*exp(c)*k) S0`` where ``T = (I + A)^-1`` and
    ``A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j)`` for ``j < i`` (strictly lower); then
    ``o_i = exp(c_i) q_i^T S0 + sum_{j<=i} exp(c_i - c_j) (q_i . k_j) u_j`` and
    ``S_end = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T``.

    A final partial chunk is zero-padded (k = v = beta = 0, g = 0): padded rows write
    nothing and decay nothing, so the returned state is exact for the real tokens.

    Returns ``(o, new_state)`` as :func:`recurrent_gated_delta_rule` does.
    Raises ValueError for ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, v, g, beta = _to_head_major(q, k, v, g, beta)
    hv, length, dk = k.shape
    dv = v.shape[-1]
    s = state.float()
    if length == 0:
        return v.new_zeros(0, hv, dv), s.clone()

    pad = (-length) % chunk_size
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        g = torch.nn.functional.pad(g, (0, pad))
        beta = torch.nn.functional.pad(beta, (0, pad))
    n_chunks = (length + pad) // chunk_size

    # [Hv, N, C, D] and [Hv, N, C]
    q = q.reshape(hv, n_chunks, chunk_size, dk)
    k = k.reshape(hv, n_chunks, chunk_size, dk)
    v = v.reshape(hv, n_chunks, chunk_size, dv)
    g = g.reshape(hv, n_chunks, chunk_size)
    beta = beta.reshape(hv, n_chunks, chunk_size)

    cum = g.cumsum(dim=-1)  # c_t
    # decay[i, j] = exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()

    k_beta = k * beta[..., None]
    strictly_lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    a_matrix = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    eye = torch.eye(chunk_size, dtype=a_matrix.dtype, device=a_matrix.device)
    system = a_matrix + eye  # unit lower triangular
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_base, w = solved[..., :dv], solved[..., dv:]  # u = u_base - w @ S0

    qk = (q @ k.transpose(-1, -2)) * decay  # intra-chunk scores, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [Hv, N]

    out = torch.empty(hv, n_chunks, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(n_chunks):
        u = u_base[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + qk[:, i] @ u
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u

    o = out.reshape(hv, n_chunks * chunk_size, dv)[:, :length]
    return o.transpose(0, 1).contiguous(), s
