"""An independent NumPy (float64) implementation of the seed equations.

Used by ``test_model.py`` to check the Flax model against the paper, given the same
parameters (read from the Flax param tree). Nothing here imports ``jaxformer``'s
layers: the embedding scale, the sinusoidal table, per-head attention, Add & Norm,
the FFN and the output projection are written out again from the paper (§3).

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H,
F d_ff, V vocabulary size, L either length.
"""

from __future__ import annotations

import numpy as np

LAYER_NORM_EPS = 1e-6


def _np(tree):
    """Param tree (jax arrays) → nested dict of float64 NumPy arrays."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: _np(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)


def positional_table(length: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)); [L, D]."""
    pe = np.zeros((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            two_i = j - (j % 2)
            angle = pos / 10000.0 ** (two_i / d_model)
            pe[pos, j] = np.sin(angle) if j % 2 == 0 else np.cos(angle)
    return pe


def layer_norm(x, p):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + LAYER_NORM_EPS) * p["scale"] + p["bias"]


def softmax_masked(scores, mask):
    """Row softmax over allowed keys; a row with no allowed key is all zeros."""
    out = np.zeros_like(scores)
    for i in range(scores.shape[0]):
        allowed = mask[i]
        if not allowed.any():
            continue
        row = scores[i][allowed]
        e = np.exp(row - row.max())
        out[i, allowed] = e / e.sum()
    return out


def multi_head_attention(p, x_TD, ctx_SD, mask_TS):
    """MultiHead(Q,K,V) = Concat(head_1..head_H) W^O, head_h = Attention(x W^Q_h, c W^K_h, c W^V_h).

    One example. ``p`` holds Flax's ``[D, H, K]`` kernels, ``[H, K]`` biases, the
    ``[H, K, D]`` output kernel and ``[D]`` output bias; ``mask_TS`` is bool.
    """
    _, num_heads, head_dim = p["query_kernel"].shape
    heads = []
    for h in range(num_heads):
        q = x_TD @ p["query_kernel"][:, h, :] + p["query_bias"][h]
        k = ctx_SD @ p["key_kernel"][:, h, :] + p["key_bias"][h]
        v = ctx_SD @ p["value_kernel"][:, h, :] + p["value_bias"][h]
        weights = softmax_masked(q @ k.T / np.sqrt(head_dim), mask_TS)
        heads.append(weights @ v)
    concat_TD = np.concatenate(heads, axis=-1)                       # [T, H*K]
    w_out = p["out_kernel"].reshape(num_heads * head_dim, -1)        # [H*K, D]
    return concat_TD @ w_out + p["out_bias"]


def feed_forward(p, x):
    """FFN(x) = max(0, x W1 + b1) W2 + b2."""
    hidden = np.maximum(0.0, x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return hidden @ p["w2"]["kernel"] + p["w2"]["bias"]


def _sublayer(x, norm_params, fn, pre: bool):
    """post: LayerNorm(x + fn(x)); pre: x + fn(LayerNorm(x))."""
    if pre:
        return x + fn(layer_norm(x, norm_params))
    return layer_norm(x + fn(x), norm_params)


def _embed(table_VD, ids_L, pe_LD):
    """Embedding × √D plus the positional rows 0..L-1."""
    d_model = table_VD.shape[1]
    return table_VD[ids_L] * np.sqrt(d_model) + pe_LD[: len(ids_L)]


def _encoder_layer(lp, x_SD, mask_SS, pre):
    x_SD = _sublayer(x_SD, lp["attention_norm"]["norm"],
                     lambda y: multi_head_attention(lp["self_attention"], y, y, mask_SS), pre)
    return _sublayer(x_SD, lp["feed_forward_norm"]["norm"],
                     lambda y: feed_forward(lp["feed_forward"], y), pre)


def _decoder_layer(lp, y_TD, memory_SD, mask_TT, mask_TS, pre):
    y_TD = _sublayer(y_TD, lp["self_attention_norm"]["norm"],
                     lambda z: multi_head_attention(lp["self_attention"], z, z, mask_TT), pre)
    y_TD = _sublayer(y_TD, lp["cross_attention_norm"]["norm"],
                     lambda z: multi_head_attention(lp["cross_attention"], z, memory_SD, mask_TS), pre)
    return _sublayer(y_TD, lp["feed_forward_norm"]["norm"],
                     lambda z: feed_forward(lp["feed_forward"], z), pre)


def transformer_logits(params, *, src, tgt, pad_id: int, share_embeddings: bool,
                       norm_position: str = "post") -> np.ndarray:
    """Logits ``[B, T, V]`` of the encoder-decoder Transformer for int ids ``src [B, S]``,
    ``tgt [B, T]`` and a Flax param dict (the ``"params"`` collection)."""
    p = _np(params)
    pre = norm_position == "pre"
    src = np.asarray(src)
    tgt = np.asarray(tgt)
    src_table = p["src_embedding"]["embedding"]
    tgt_table = src_table if share_embeddings else p["tgt_embedding"]["embedding"]
    d_model = src_table.shape[1]
    pe = positional_table(max(src.shape[1], tgt.shape[1]), d_model)
    enc_layers = sorted((k for k in p["encoder"] if k.startswith("layer_")), key=lambda k: int(k[6:]))
    dec_layers = sorted((k for k in p["decoder"] if k.startswith("layer_")), key=lambda k: int(k[6:]))
    out = []
    for b in range(src.shape[0]):
        s_ids, t_ids = src[b], tgt[b]
        src_keys = s_ids != pad_id                                   # [S]
        tgt_keys = t_ids != pad_id                                   # [T]
        S, T = len(s_ids), len(t_ids)
        enc_mask = np.broadcast_to(src_keys[None, :], (S, S))
        cross_mask = np.broadcast_to(src_keys[None, :], (T, S))
        causal = np.tril(np.ones((T, T), dtype=bool))
        dec_mask = causal & tgt_keys[None, :]

        x = _embed(src_table, s_ids, pe)
        for name in enc_layers:                                      # chained: x feeds the next
            x = _encoder_layer(p["encoder"][name], x, enc_mask, pre)
        if pre:
            x = layer_norm(x, p["encoder"]["final_norm"])
        memory = x

        y = _embed(tgt_table, t_ids, pe)
        for name in dec_layers:                                      # chained: y feeds the next
            y = _decoder_layer(p["decoder"][name], y, memory, dec_mask, cross_mask, pre)
        if pre:
            y = layer_norm(y, p["decoder"]["final_norm"])

        if share_embeddings:
            logits = y @ tgt_table.T
        else:
            logits = y @ p["output_projection"]["kernel"] + p["output_projection"]["bias"]
        out.append(logits)
    return np.stack(out)


def attention(q, k, v, mask=None):
    """softmax(Q Kᵀ / √K) V for ``[B, H, T, K]`` arrays; returns (outputs, weights)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, T, K = q.shape
    S = k.shape[2]
    mask = np.ones((B, H, T, S), bool) if mask is None else np.broadcast_to(np.asarray(mask), (B, H, T, S))
    weights = np.zeros((B, H, T, S))
    for b in range(B):
        for h in range(H):
            weights[b, h] = softmax_masked(q[b, h] @ k[b, h].T / np.sqrt(K), mask[b, h])
    return weights @ v, weights
