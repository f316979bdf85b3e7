"""A tiny random-weight Llama and a byte-level BPE tokenizer, built offline (no hub access)."""

from __future__ import annotations

import os
import sys


def build(out: str, seed: int = 0) -> str:
    """Write a 2-layer Llama (head_dim 64, 1 KV head) and its tokenizer to ``out``; return ``out``."""
    import pydoc_data.topics
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(pydoc_data.topics.topics.values())[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
