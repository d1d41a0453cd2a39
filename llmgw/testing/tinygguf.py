"""
A tiny random-weight Llama model in GGUF, for running a real engine
(llama.cpp's C{llama-server}) in tests: a test tool, not a model.

Two layers, a 64-wide embedding, a vocabulary of its own (the three special
tokens, the 256 byte tokens and a few words) and a chat template: about
half a megabyte, written in well under a second. Its replies are random
words of its vocabulary (never an end of text, so a reply is always as
long as asked); what it proves is the engine's real start, readiness,
serving, metrics and death, not the text.

    python -m llmgw.testing.tinygguf OUT.gguf

L{write_lora} writes a LoRA adapter for it that changes its answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: A Jinja chat template llama-server's own renderer accepts.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_WORDS = ["\u2581the", "\u2581a", "\u2581model", "\u2581reply", "\u2581tiny", "\u2581llmgw", "\u2581is", "."]

EMBEDDING = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 512


def vocabulary(spelled: bool = False) -> tuple[list[str], list[float], list[int]]:
    """
    Tokens, scores and token types (SentencePiece kinds: 1 normal, 2
    unknown, 3 control, 6 byte). C{spelled}: the words' prefixes too
    (before the words), which SentencePiece's merges need to reach a word
    from its letters, so that a reply's text tokenizes back to the words
    it was generated as.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * 3 + [-1000.0] * 256
    if spelled:
        prefixes = sorted({w[:i] for w in _WORDS for i in range(2, len(w))} - set(_WORDS))
        tokens += prefixes
        types += [1] * len(prefixes)
        scores += [-100.0] * len(prefixes)
    tokens += _WORDS
    types += [1] * len(_WORDS)
    scores += [-float(i) for i in range(len(_WORDS))]
    return tokens, scores, types


def write(path: str | Path, seed: int = 11, spelled: bool = False, context: int = CONTEXT) -> Path:
    """
    Write the model to C{path}; returns the path. C{spelled}: a vocabulary
    whose text tokenizes back to the same words (L{vocabulary}), for tests
    that send a reply's text back to the engine. C{context}: its training
    context, which caps an engine's context per request (a long reply takes
    long enough to be cut in the middle).

    @raise ImportError: the C{gguf} package (the C{test} extra) is missing.
    """
    import gguf  # type: ignore[import-untyped]
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary(spelled)
    vocab = len(tokens)
    head_dim = EMBEDDING // HEADS

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llmgw-tiny")
    w.add_context_length(context)
    w.add_embedding_length(EMBEDDING)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FEED_FORWARD)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int) -> None:
        data = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        w.add_tensor(name, data)

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones((EMBEDDING,), dtype=np.float32))

    # numpy shapes are (out, in), as GGUF's Python writer expects.
    tensor("token_embd.weight", vocab, EMBEDDING)
    for i in range(LAYERS):
        ones(f"blk.{i}.attn_norm.weight")
        tensor(f"blk.{i}.attn_q.weight", EMBEDDING, EMBEDDING)
        tensor(f"blk.{i}.attn_k.weight", EMBEDDING, EMBEDDING)
        tensor(f"blk.{i}.attn_v.weight", EMBEDDING, EMBEDDING)
        tensor(f"blk.{i}.attn_output.weight", EMBEDDING, EMBEDDING)
        ones(f"blk.{i}.ffn_norm.weight")
        tensor(f"blk.{i}.ffn_gate.weight", FEED_FORWARD, EMBEDDING)
        tensor(f"blk.{i}.ffn_up.weight", FEED_FORWARD, EMBEDDING)
        tensor(f"blk.{i}.ffn_down.weight", EMBEDDING, FEED_FORWARD)
    ones("output_norm.weight")
    # Only the words can win: their output rows are large, every other row
    # (special and byte tokens) is zero. Replies are then whole words, never
    # an end of text or half a UTF-8 sequence an engine would hold back.
    output = np.zeros((vocab, EMBEDDING), dtype=np.float32)
    first_word = vocab - len(_WORDS)
    output[first_word:] = rng.standard_normal((len(_WORDS), EMBEDDING)) * 2.0
    w.add_tensor("output.weight", output)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: The base tensors L{write_lora} adapts (each layer's attention and
#: feed-forward projections, and the output).
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_lora(path: str | Path, seed: int = 23, spelled: bool = False, rank: int = 4,
               alpha: float = 4.0, strength: float = 1.0) -> Path:
    """
    Write a LoRA adapter for the model L{write} makes (same C{spelled}) to
    C{path}; returns the path. In llama.cpp's adapter GGUF: C{general.type
    = "adapter"}, C{adapter.type = "lora"}, C{adapter.lora.alpha}, and for
    each adapted base tensor C{NAME.lora_a} (rank x in) and C{NAME.lora_b}
    (out x rank). Its update to the output is large (C{strength}), so that
    at temperature 0 the adapted model answers otherwise than the base.

    @raise ImportError: the C{gguf} package (the C{test} extra) is missing.
    """
    import gguf
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary(spelled)[0])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)

    def pair(name: str, out: int, inp: int, scale: float, rows_from: int = 0) -> None:
        # numpy shapes are (out, in): A maps in -> rank, B rank -> out.
        w.add_tensor(f"{name}.weight.lora_a", (rng.standard_normal((rank, inp)) * scale).astype(np.float32))
        b = (rng.standard_normal((out, rank)) * scale).astype(np.float32)
        b[:rows_from] = 0.0
        w.add_tensor(f"{name}.weight.lora_b", b)

    shapes = {"attn_q": (EMBEDDING, EMBEDDING), "attn_k": (EMBEDDING, EMBEDDING),
              "attn_v": (EMBEDDING, EMBEDDING), "attn_output": (EMBEDDING, EMBEDDING),
              "ffn_gate": (FEED_FORWARD, EMBEDDING), "ffn_up": (FEED_FORWARD, EMBEDDING),
              "ffn_down": (EMBEDDING, FEED_FORWARD)}
    for i in range(LAYERS):
        for target in LORA_TARGETS:
            pair(f"blk.{i}.{target}", *shapes[target], 0.3 * strength)
    # As in the base, only the words' output rows move: replies stay words.
    pair("output", vocab, EMBEDDING, 1.5 * strength, rows_from=vocab - len(_WORDS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m llmgw.testing.tinygguf OUT.gguf", file=sys.stderr)
        sys.exit(2)
    print(write(sys.argv[1]))
