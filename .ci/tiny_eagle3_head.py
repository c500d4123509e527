"""Build a tiny random EAGLE3 draft head for the tiny Llama target, for live tests.

Usage: python .ci/tiny_eagle3_head.py TARGET_DIR OUT_DIR [--draft-vocab 128]

Runs in the vLLM venv (needs torch and safetensors); nothing is downloaded. The head has the
layout vLLM loads as ``LlamaForCausalLMEagle3`` (an EAGLE3 checkpoint such as
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), in the same proportions to its target:

- ``fc``: three of the target's hidden states (early, middle, late layer; 3 x hidden) down to
  hidden;
- one decoder layer (``midlayer``) of the target's width, heads and MLP, whose attention reads
  the token embedding and the hidden state side by side (2 x hidden in), with ``hidden_norm``;
- ``norm`` and an LM head over a draft vocabulary a quarter of the target's (32,000 of
  128,256 in the 8B head), with ``d2t`` (draft id -> target id offsets) and ``t2d``;
- no embedding: the drafter shares the target's.

The weights are random (seed 0), so its drafts match the target's tokens no more than chance.
Serve it with vLLM's synthetic rejection sampling (``rejection_sample_method: synthetic`` and
``synthetic_acceptance_length``): the drafter still runs every pass and costs what it costs,
while which drafts are accepted is drawn at the configured rate.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="the target model's folder (its config.json)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="draft vocabulary (default: a quarter of the target's)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    target = json.loads((args.target / "config.json").read_text())
    hidden, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    vocab = target["vocab_size"]
    draft_vocab = args.draft_vocab or max(1, vocab // 4)
    if not 1 <= draft_vocab <= vocab:
        raise SystemExit(f"--draft-vocab: must be 1..{vocab} (got {draft_vocab})")

    layers = target["num_hidden_layers"]
    aux_layers = sorted({min(2, layers - 1), layers // 2, max(0, layers - 2)})
    if len(aux_layers) != 3:
        raise SystemExit(f"the target has {layers} layers; an EAGLE3 head reads three distinct ones")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    std = target.get("initializer_range", 0.02)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.hidden_norm.weight": ones(hidden),
        "midlayer.input_layernorm.weight": ones(hidden),
        "midlayer.post_attention_layernorm.weight": ones(hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        # Draft id i is target id i + d2t[i]: the first draft_vocab target ids.
        "d2t": torch.zeros(draft_vocab, dtype=torch.long),
        "t2d": torch.arange(vocab) < draft_vocab,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": target.get("hidden_act", "silu"),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rope_parameters": target.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        # Which target layers' outputs feed fc: early, middle, late, as (2, 16, 29) of 32 in the
        # 8B head. vLLM's default, (2, L // 2, L - 3), repeats a layer when L = 6.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers},
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (args.target / name).exists():
            shutil.copy(args.target / name, out / name)
    params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
    info = {"target": args.target.name, "draft_vocab": draft_vocab, "parameters": params}
    (out / "simcap_tiny_model.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"tiny EAGLE3 head: {params / 1e6:.2f} M parameters, draft vocab {draft_vocab}, in {out}")


if __name__ == "__main__":
    main()
