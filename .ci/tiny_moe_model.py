"""Build a tiny random Qwen3-MoE model with the tiny models' byte-level BPE tokenizer.

Usage: python .ci/tiny_moe_model.py OUT_DIR [--experts 64 --top-k 8 ...]

Runs in the vLLM venv (needs torch, transformers, tokenizers); nothing is downloaded. Defaults:
4 layers, hidden 512, 8 heads (head_dim 64), 2 KV heads, 64 experts of width 512 in every
layer, 8 experts per token, ``norm_topk_prob`` left at transformers' default, bf16: about
205M parameters (almost all in the experts), about 400 MB. The weights are random (seed 0),
so the output is nonsense; its purpose is a step time shaped by MoE expert work, which grows
with the number of distinct experts a batch touches, unlike a dense model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tiny_model import save_model, save_tokenizer, special_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--max-positions", type=int, default=4096)
    args = ap.parse_args()

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out: Path = args.out
    tokenizer = save_tokenizer(out, args.vocab)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.expert_width,  # dense MLP width: unused, every layer is MoE
        moe_intermediate_size=args.expert_width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **special_token_ids(tokenizer),
    )
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    save_model(model, out, tokenizer, args.vocab, what="tiny MoE model")


if __name__ == "__main__":
    main()
