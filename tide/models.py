"""A small Llama-like decoder for tests, benchmarks and ``tide.train``.

Token embedding, ``n_layers`` blocks of (RMSNorm, causal multi-head attention with RoPE, RMSNorm,
SwiGLU MLP), a final RMSNorm and an untied or tied output head. The preset sizes are chosen so that
several parameters shard unevenly on 2, 3 and 4 ranks (FSDP2 pads their last shards).
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


# tiny: vocab 67 is uneven on 2/3/4 ranks, dim 30 on 4, ffn 44 on 3; small and medium for timing.
PRESETS = {
    "tiny": LlamaConfig(vocab=67, dim=30, n_layers=2, n_heads=3, ffn_dim=44, seq_len=16),
    "small": LlamaConfig(vocab=1003, dim=256, n_layers=4, n_heads=4, ffn_dim=682, seq_len=64),
    "medium": LlamaConfig(vocab=8009, dim=512, n_layers=8, n_heads=8, ffn_dim=1366, seq_len=128),
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


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

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


def batch(cfg: LlamaConfig, step: int, rank: int, batch_size: int = 2, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) for one step of one rank: every run sees the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
