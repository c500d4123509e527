"""Build a tiny random Llama model with a byte-level BPE tokenizer, for live tests.

Usage: python .ci/tiny_model.py OUT_DIR [--hidden 384 --layers 6 ...]

Runs in the vLLM venv (needs torch, transformers, tokenizers); nothing is downloaded. The
weights are random (seed 0), so the model emits nonsense and ends early unless the request
sets ``ignore_eos``; its only purpose is realistic engine work: step time that depends on the
batch (prefill tokens, decode requests, context length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A capacity simulator predicts latency and throughput of a serving engine.",
    "Each engine step schedules decodes first and fills the rest with prefill chunks.",
    "Requests share a system prompt, so prefix caching saves most of the prompt work.",
    "Time to first token, time per output token and inter token latency are measured.",
    "Tokens arrive in stream chunks; one chunk may carry several tokens.",
    "Pack my box with five dozen liquor jugs, then sing a song of sixpence.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols: ( ) [ ] { } < > = + - * / % #",
]


def corpus() -> list[str]:
    """A deterministic corpus big enough for a 512-token BPE vocabulary."""
    words = sorted({w.strip(".,;:()") for s in SENTENCES for w in s.split()} - {""})
    lines = list(SENTENCES)
    for i, w in enumerate(words):  # recombine words so pairs recur and merges form
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 12)))
    return lines * 4


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(out: Path, vocab: int):
    """Build the BPE tokenizer (at most ``vocab`` tokens), save it into ``out``, return it."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    tokenizer.save_pretrained(out)
    if len(tokenizer) > vocab:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens, more than the model vocab {vocab}")
    return tokenizer


def special_token_ids(tokenizer) -> dict[str, int]:
    """The bos/eos/pad ids for a model config."""
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def save_model(model, out: Path, tokenizer, model_vocab: int, what: str = "tiny model") -> None:
    """Save ``model`` (safetensors) without generation defaults, and a small info file."""
    model.save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():  # no sampling defaults for vLLM to pick up
        gen.unlink()
    params = sum(p.numel() for p in model.parameters())
    info = {"tokenizer_vocab": len(tokenizer), "model_vocab": model_vocab, "parameters": params}
    (out / "simcap_tiny_model.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"{what}: {params / 1e6:.1f} M parameters, tokenizer vocab {len(tokenizer)}, in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-positions", type=int, default=4096)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out: Path = args.out
    tokenizer = save_tokenizer(out, args.vocab)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **special_token_ids(tokenizer),
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    save_model(model, out, tokenizer, args.vocab)


if __name__ == "__main__":
    main()
