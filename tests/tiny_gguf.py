"""A tiny llama-architecture model in GGUF, made on the spot, for tests against a real engine.

No model can be downloaded where the tests run, and the tests need none that is any good: they
need one that llama.cpp loads and generates with. This writes one with the ``gguf`` package:

- weights: random (seeded), two layers, 64-wide, f32, about half a megabyte;
- vocabulary: SentencePiece style (``tokenizer.ggml.model = llama``): ``<unk>``, ``<s>``,
  ``</s>``, the 256 byte-fallback tokens (so any text tokenizes), then printable characters and a
  few hundred word pieces, each starting a word with ``▁``;
- a ChatML chat template, so ``/v1/chat/completions`` works.

The model never ends a generation by itself and never emits a byte token: embedding dimension 0
carries a constant that no layer writes to, so after the final norm it is a large positive number
in every position, and the output rows of the special and byte tokens weigh it strongly negative.
A request therefore always generates exactly ``max_tokens`` tokens of valid UTF-8 text.

Usage: ``python tests/tiny_gguf.py OUT.gguf``.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path
from typing import Final

import gguf
import numpy as np

N_EMBD: Final = 64
N_LAYER: Final = 2
N_HEAD: Final = 4
N_FF: Final = 128
N_CTX_TRAIN: Final = 32768
CHATML: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORD_TEXT: Final = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal"
)
WORDS: Final = tuple(_WORD_TEXT.split())


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, their merge scores and their types, in id order."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁", *(c for c in string.printable if not c.isspace()), *(f"▁{w}" for w in WORDS)]
    tokens += list(dict.fromkeys(pieces))
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(types))
    # SentencePiece merges the pair whose result scores highest: longer pieces first.
    scores = [0.0 if kind != gguf.TokenType.NORMAL else float(len(tok)) for tok, kind in
              zip(tokens, types, strict=True)]  # fmt: skip
    return tokens, scores, [int(kind) for kind in types]


def write_model(path: Path, seed: int = 0) -> Path:
    """Write the model to ``path`` and return it."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)

    def weights(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML)

    embeddings = weights(n_vocab, N_EMBD, scale=1.0)
    embeddings[:, 0] = 8.0  # the constant dimension (module docstring)
    output = weights(n_vocab, N_EMBD, scale=1.0)
    output[:, 0] = 0.0
    normal = np.array(types) == int(gguf.TokenType.NORMAL)
    output[~normal, 0] = -100.0
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(N_LAYER):
        attn_output = weights(N_EMBD, N_EMBD)
        ffn_down = weights(N_EMBD, N_FF)
        attn_output[0, :] = 0.0  # no layer writes to the constant dimension
        ffn_down[0, :] = 0.0
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{prefix}.attn_output.weight", attn_output)
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{prefix}.ffn_down.weight", ffn_down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    print(write_model(Path(sys.argv[1])))
