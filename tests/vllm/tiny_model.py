"""Write a tiny random-weight Llama with its own tokenizer and chat template, for real vLLM CPU
engines in tests (shared/design/real-vllm-cpu.md: "A model without a hub").

Runs under the vLLM venv's Python (transformers, tokenizers and torch live there, not in the
project's venv):

    .venv-vllm/bin/python tests/vllm/tiny_model.py OUT_DIR

LlamaConfig(vocab 1024, hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads: head size
32, which vLLM's CPU attention supports), weights drawn with a fixed seed and saved in bfloat16;
a byte-level BPE tokenizer trained on a few sentences (so every byte is encodable) with BOS/EOS;
a chat template that starts with BOS and frames each turn, so that turn n+1's tokens extend
turn n's. Nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "You are a helpful assistant. Answer briefly and kindly.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Routing requests to replicas that hold their prefix saves prefill time.",
    "Question: what is the capital of France? Answer: Paris is the capital.",
    "Tenant system prompt: be precise, cite sources, and keep answers short.",
] * 20


def write(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
