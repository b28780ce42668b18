"""A Llama-like decoder for tests, benchmarks and ``tide.train``.

Token embedding, ``n_layers`` blocks of (RMSNorm, causal multi-head attention with RoPE, RMSNorm,
SwiGLU MLP or a mixture of SwiGLU experts), a final RMSNorm and an untied or tied output head. The small
presets are sized so that several parameters shard unevenly on 2, 3 and 4 ranks (FSDP2 pads their last
shards); ``llama8b`` and ``moe`` have the block shapes of Llama-3.1-8B and Qwen3-30B-A3B (fewer blocks).

Mixture of experts (``n_experts > 0``): a linear router picks ``top_k`` experts per token (softmax, then
the chosen weights renormalised); the experts' weights are 3-D parameters whose dim 0 is the expert
(so FSDP2 shards experts), applied with grouped GEMMs over the tokens sorted by expert
(``torch._grouped_mm`` on Hopper, a loop over experts elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    seq_len: int
    tie_embeddings: bool = False
    n_experts: int = 0  # > 0: the MLP is a mixture of this many SwiGLU experts of expert_ffn_dim
    top_k: int = 0
    expert_ffn_dim: int = 0


# tiny: vocab 67 is uneven on 2/3/4 ranks, dim 30 on 4, ffn 44 on 3; small and medium for timing.
PRESETS = {
    "tiny": LlamaConfig(vocab=67, dim=30, n_layers=2, n_heads=3, ffn_dim=44, seq_len=16),
    "small": LlamaConfig(vocab=1003, dim=256, n_layers=4, n_heads=4, ffn_dim=682, seq_len=64),
    "medium": LlamaConfig(vocab=8009, dim=512, n_layers=8, n_heads=8, ffn_dim=1366, seq_len=128),
    "tiny_moe": LlamaConfig(vocab=67, dim=32, n_layers=2, n_heads=2, ffn_dim=0, seq_len=16, n_experts=6, top_k=2,
                            expert_ffn_dim=24),
    # Block shapes of Llama-3.1-8B and Qwen3-30B-A3B (attention without grouped KV heads), 4 blocks;
    # the benchmarks set n_layers and seq_len.
    "llama8b": LlamaConfig(vocab=128256, dim=4096, n_layers=4, n_heads=32, ffn_dim=14336, seq_len=4096),
    "moe": LlamaConfig(vocab=151936, dim=2048, n_layers=4, n_heads=16, ffn_dim=0, seq_len=2048, n_experts=128,
                       top_k=8, expert_ffn_dim=768),
}


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.n_heads
        q, k, v = (w(x).view(b, s, h, d // h).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``[offs[e-1], offs[e])`` of ``a`` times ``b[e]``, for every expert e (``b``: (E, K, N))."""
    if a.is_cuda and a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9:
        return torch._grouped_mm(a, b, offs=offs)
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        bound_in, bound_out = cfg.dim ** -0.5, cfg.expert_ffn_dim ** -0.5
        self.w_gate = nn.Parameter(torch.empty(cfg.n_experts, cfg.expert_ffn_dim, cfg.dim)
                                   .uniform_(-bound_in, bound_in))
        self.w_up = nn.Parameter(torch.empty(cfg.n_experts, cfg.expert_ffn_dim, cfg.dim).uniform_(-bound_in, bound_in))
        self.w_down = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
                                   .uniform_(-bound_out, bound_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        t = x.reshape(-1, d)
        weights, experts = self.router(t).float().softmax(-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        order = experts.flatten().argsort(stable=True)  # (token, choice) pairs sorted by expert
        token = order // self.top_k
        offs = torch.bincount(experts.flatten(), minlength=self.w_gate.shape[0]).cumsum(0).to(torch.int32)
        xs = t[token]
        h = F.silu(grouped_mm(xs, self.w_gate.transpose(1, 2), offs)) * grouped_mm(xs, self.w_up.transpose(1, 2), offs)
        y = grouped_mm(h, self.w_down.transpose(1, 2), offs) * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(t).index_add_(0, token, y).view(b, s, d)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MoE(cfg) if cfg.n_experts > 0 else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError(f"Llama: dim={cfg.dim} must split into {cfg.n_heads} heads of even size (RoPE)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        half = cfg.dim // cfg.n_heads // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def batch(cfg: LlamaConfig, step: int, rank: int, batch_size: int = 2, device="cpu",
          seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for one step of one rank: every run sees the same data.
    ``seq_len`` (default ``cfg.seq_len``, at most that) sets the tokens per sequence."""
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= cfg.seq_len:
        raise ValueError(f"batch: seq_len must be in [1, {cfg.seq_len}], got {seq_len}")
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, cfg.vocab, (batch_size, seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
