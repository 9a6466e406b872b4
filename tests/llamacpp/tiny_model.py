"""Write a tiny random-weight llama GGUF for the real-engine test tier (no model is downloaded).

The model is useless as a language model but exercises a real engine end to end: 4 layers,
hidden 256, FFN 768, 4 heads, trained context 8192 (~3.7M parameters, ~7.5 MB in f16), a
SentencePiece-style `llama` tokenizer (specials, 256 byte-fallback tokens, printable ASCII and
some word pieces) and a ChatML chat template, so `/v1/chat/completions` works.

Generation never stops early: every row of the output head for an end-of-generation, control
or byte token is zero (logit 0), and the rows of the text tokens come in pairs `w, -w`, so for
any hidden state some text token has a logit >= |other logit| > 0. At temperature 0 every
request therefore runs to `max_tokens` and emits printable text, deterministically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

N_LAYER = 4
N_EMBD = 256
N_FF = 768
N_HEAD = 4
N_CTX_TRAIN = 8192

SPACE = "\u2581"  # SentencePiece's word-boundary marker
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK, BOS, EOS, IM_START, IM_END = range(5)
WORDS = """the of and to in is you that it for are on with as be this at or by from your not
have can will all an but we they if do more when what which use about one other time each how
assistant system user request replica cache prefix token engine storage team question answer
please help call route load balancer server model prompt reply""".split()
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, SentencePiece scores (longer pieces merge first) and GGUF token types."""
    from gguf import TokenType

    tokens = list(SPECIALS)
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    text = [SPACE] + [chr(c) for c in range(33, 127)]
    # SentencePiece merges two adjacent pieces at a time, so every prefix of a word piece is a token too
    for word in [SPACE + w for w in WORDS] + [w for w in WORDS if len(w) > 2]:
        text += [word[:n] for n in range(2, len(word) + 1)]
    text = list(dict.fromkeys(text))
    tokens += text
    types += [TokenType.NORMAL] * len(text)
    scores = [0.0] * (len(SPECIALS) + 256) + [float(len(t)) - i * 1e-4 for i, t in enumerate(text)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(path: str | Path, seed: int = 0) -> Path:
    """Write the model to `path` (overwritten) and return it."""
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    first_text = len(SPECIALS) + 256

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("kvroute-tiny-random")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(IM_END)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        ones = np.ones(N_EMBD, dtype=np.float32)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones.copy())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    head = np.zeros((n_vocab, N_EMBD), dtype=np.float16)  # specials and bytes: logit 0, never the max
    n_pairs = (n_vocab - first_text) // 2
    half = mat(n_pairs, N_EMBD)
    head[first_text:first_text + 2 * n_pairs:2] = half
    head[first_text + 1:first_text + 2 * n_pairs:2] = -half
    w.add_tensor("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    import sys

    print(write_tiny_gguf(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf"))
