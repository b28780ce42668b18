"""Parameter shapes of one decoder layer of the models the preprint evaluates (HF module layout)."""
from __future__ import annotations


def llama_layer(hidden: int, heads: int, kv_heads: int, intermediate: int) -> list[tuple[int, ...]]:
    head_dim = hidden // heads
    return [
        (hidden,),                       # input_layernorm
        (heads * head_dim, hidden),      # q_proj
        (kv_heads * head_dim, hidden),   # k_proj
        (kv_heads * head_dim, hidden),   # v_proj
        (hidden, heads * head_dim),      # o_proj
        (hidden,),                       # post_attention_layernorm
        (intermediate, hidden),          # gate_proj
        (intermediate, hidden),          # up_proj
        (hidden, intermediate),          # down_proj
    ]


def qwen3_moe_layer(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, moe_intermediate=768):
    shapes = [
        (hidden,), (heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
        (hidden, heads * head_dim), (head_dim,), (head_dim,),  # q_norm, k_norm
        (hidden,), (experts, hidden),                          # post_attention_layernorm, router
    ]
    for _ in range(experts):  # per-expert gate/up/down, as in the HF module tree
        shapes += [(moe_intermediate, hidden), (moe_intermediate, hidden), (hidden, moe_intermediate)]
    return shapes


# name -> (layer shapes, number of layers)
MODELS = {
    "llama3.1-8b": (llama_layer(4096, 32, 8, 14336), 32),
    "llama3.1-70b": (llama_layer(8192, 64, 8, 28672), 80),
    "qwen3-30b-a3b": (qwen3_moe_layer(), 48),
}


def shrink(shapes: list[tuple[int, ...]], factor: int) -> list[tuple[int, ...]]:
    """Divide every dim by ``factor`` (at least 1): a quick CPU smoke run of a GPU benchmark."""
    return [tuple(max(1, d // factor) for d in s) for s in shapes]
