"""DESIGN sections 1-2 in float64 PyTorch, written for the tests from the design text (not from the
library's code): routing (sigmoid or softmax scores, the correction bias, group-limited selection, ties to
the lower index, renormalisation, scaling), the latent down projection, the routed experts (silu, situ,
relu2; dense or MXFP4-decoded), the latent RMSNorm, the up projection, the shared expert, the zero
experts; and the reference runner's tails over every rank's partials.

Routing keeps the two roundings the design's kernels make and the comparison must reproduce to pick the
same experts: each score is held in float32 and the biased score is a float32 sum (a float64 selection
could order two experts differently than any fp32 kernel when their scores differ below fp32's
resolution). Everything else is float64 without intermediate rounding.
"""

import math

import torch

F64 = torch.float64


# --- routing -------------------------------------------------------------------------------------------

def _ranked(values, candidates=None):
    """Indices of `values` (1-d) from the highest down, the lower index first on a tie."""
    order = torch.sort(-values, stable=True).indices  # stable: equal values keep the lower index first
    if candidates is not None:
        order = order[candidates[order]]
    return order


def route(config, logits, bias=None):
    """topk_ids [T, k] int64, topk_weights [T, k] float64 and the zero experts' weight sum [T] float64."""
    num_experts = config["n_routed_experts"]
    outputs = num_experts + config["zero_expert_num"]
    k = config["num_experts_per_tok"]
    n_group, topk_group = config["n_group"], config["topk_group"]
    logits = logits.to(F64)
    if config["scoring_func"] == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    scores = scores.to(torch.float32)
    biased = scores if bias is None else scores + bias.to(torch.float32)
    ids = torch.empty((logits.shape[0], k), dtype=torch.int64)
    weights = torch.empty((logits.shape[0], k), dtype=F64)
    for t in range(logits.shape[0]):
        candidates = torch.ones(outputs, dtype=torch.bool)
        if n_group > 1:
            size = outputs // n_group
            groups = biased[t].view(n_group, size)
            best_two = torch.sort(groups, dim=1, descending=True).values[:, : min(2, size)]
            group_score = best_two.sum(dim=1, dtype=torch.float32)
            kept = _ranked(group_score)[:topk_group]
            candidates[:] = False
            for g in kept.tolist():
                candidates[g * size : (g + 1) * size] = True
        chosen = _ranked(biased[t], candidates)[:k]
        ids[t] = chosen
        w = scores[t, chosen].to(F64)
        if config["norm_topk_prob"]:
            w = w / w.sum()
        weights[t] = w * config["routed_scaling_factor"]
    zero = torch.where(ids >= num_experts, weights, torch.zeros_like(weights)).sum(dim=1)
    return ids, weights, zero


# --- the layer -------------------------------------------------------------------------------------------

def activation(config, g, u):
    act = config["hidden_act"]
    if act == "silu":
        return g * torch.sigmoid(g) * u
    if act == "situ":
        b1, b2 = config["situ_beta"], config["situ_linear_beta"]
        return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))
    if act == "relu2":
        return torch.relu(u) ** 2
    raise ValueError(act)


def mlp(config, x, gate, up, down):
    """act(x gate^T, x up^T) down^T (relu2: relu(x up^T)^2 down^T), float64."""
    u = x @ up.T
    g = x @ gate.T if gate is not None else None
    return activation(config, g, u) @ down.T


def rms_norm(v, gamma, eps):
    return v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + eps) * gamma


def layer(config, w, x, logits=None, latent_states=None):
    """DESIGN section 1 on full weights `w` (float64 tensors by role: gate, score_bias, down_proj, latent_norm,
    up_proj, experts_gate/up/down as lists per expert, shared_gate/up/down). Returns (out, ids, weights)."""
    x = x.to(F64)
    if logits is None:
        logits = x @ w["gate"].T
    ids, weights, zero = route(config, logits, w.get("score_bias"))
    z = latent_states.to(F64) if latent_states is not None else x @ w["down_proj"].T
    latent = latent_partial(config, w, z, ids, weights, range(config["n_routed_experts"]))
    routed = routed_output(config, w, latent)
    shared = shared_partial(config, w, x) if config["shared_expert_intermediate_size"] > 0 else 0.0
    return routed + shared + zero[:, None] * x, ids, weights


def latent_partial(config, w, z, ids, weights, experts, rows=None):
    """sum over the token's chosen experts (among `experts`) of weight * expert(z), optionally with only
    `rows` (a slice of I) of every expert: a rank's un-reduced L_r."""
    rows = rows if rows is not None else slice(None)
    gated = config["hidden_act"] != "relu2"
    out = torch.zeros((z.shape[0], config["moe_latent_size"]), dtype=F64)
    for e in experts:
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate = w["experts_gate"][e][rows] if gated else None
        y = mlp(config, z[tokens], gate, w["experts_up"][e][rows], w["experts_down"][e][:, rows])
        out.index_add_(0, tokens, weights[tokens, slots, None] * y)
    return out


def routed_output(config, w, latent):
    if config["latent_moe_use_norm"]:
        latent = rms_norm(latent, w["latent_norm"], config["rms_norm_eps"])
    return latent @ w["up_proj"].T


def shared_partial(config, w, x, rows=None):
    rows = rows if rows is not None else slice(None)
    gated = config["hidden_act"] != "relu2"
    gate = w["shared_gate"][rows] if gated else None
    return mlp(config, x.to(F64), gate, w["shared_up"][rows], w["shared_down"][:, rows])


# --- the tails (the reference runner's, over every rank's partials) -------------------------------------

def _norm(latent, norm_weight, eps):
    return latent if norm_weight is None else rms_norm(latent, norm_weight, eps)


def tail_native(shared, latent, norm_weight, up, eps):
    """L = AR(L_r); out = norm(L) W_up^T; S = AR(S_r); out += S (the base runner's path)."""
    return _norm(sum(latent), norm_weight, eps) @ up.T + sum(shared)


def tail_fusion(shared, latent, norm_weight, up, eps):
    """Tier 0: Lhat = norm(AR(L_r)), Sh_r = RS(S_r); out_r = Lhat W_up[shard_r]^T + Sh_r; AG(out_r)."""
    tp = len(shared)
    d = up.shape[0]
    lhat = _norm(sum(latent), norm_weight, eps)
    reduced = sum(shared)
    blocks = []
    for r in range(tp):
        cols = slice(r * d // tp, (r + 1) * d // tp)
        blocks.append(lhat @ up[cols].T + reduced[:, cols])
    return torch.cat(blocks, dim=1)


def tail_allreduce_overlap(shared, latent, norm_weight, up, eps):
    """Tier 1: Lhat = AR+norm(L_r); result = Lhat W_up^T; result += AR(S_r)."""
    result = _norm(sum(latent), norm_weight, eps) @ up.T
    return result + sum(shared)


def tail_column_parallel(shared, latent, norm_weight, up, eps):
    """Tier 2: Lhat = AR+norm(L_r); S_r[:, shard_r] += Lhat W_up[shard_r]^T; out = AR(S_r)."""
    tp = len(shared)
    d = up.shape[0]
    lhat = _norm(sum(latent), norm_weight, eps)
    accumulated = []
    for r in range(tp):
        s = shared[r].clone()
        cols = slice(r * d // tp, (r + 1) * d // tp)
        s[:, cols] += lhat @ up[cols].T
        accumulated.append(s)
    return sum(accumulated)


TAILS = {
    "native": tail_native,
    "tail_fusion": tail_fusion,
    "allreduce_overlap": tail_allreduce_overlap,
    "column_parallel": tail_column_parallel,
}


# --- MXFP4 (compressed-tensors mxfp4-pack-quantized), written from the format's description -------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=F64)


def pack_mxfp4(codes):
    """[rows, cols] 4-bit codes (0..15) -> [rows, cols/2] uint8, the even column in the low nibble."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def decode_mxfp4(packed, scales):
    """[rows, cols/2] codes and [rows, cols/32] E8M0 scales -> [rows, cols] float64 values."""
    low = (packed & 0xF).long()
    high = (packed >> 4).long()
    codes = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)
    values = E2M1[codes]
    exponent = scales.to(F64) - 127.0
    return values * torch.pow(2.0, exponent).repeat_interleave(32, dim=1)


def tolerance(dtype):
    """max |out - ref| / max |ref| allowed per compute dtype: activations stored in the dtype (z, a, the
    partials, Lhat) against a float64 reference that rounds nothing."""
    return TOLERANCES[dtype]


TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def relative_error(out, ref):
    out = out.to(F64)
    diff = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    if math.isnan(diff):
        return math.inf
    return diff / scale if scale > 0 else diff
