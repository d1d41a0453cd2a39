"""
A tiny random-weight Llama model as a Hugging Face model directory
(C{config.json}, safetensors weights, a tokenizer and its chat template),
for running vLLM's CPU build in tests: a test tool, not a model. Nothing
is fetched from a hub: the weights come from C{transformers}, the
tokenizer from the C{tokenizers} library over a word list of its own.

Two layers, a 64-wide embedding, two heads of 32 (vLLM's CPU attention
takes head sizes of 32 and up, not llama.cpp's 16), a context of 512, a
vocabulary of three special tokens and a few hundred made-up words: about
half a megabyte. Its replies are random words of its vocabulary (never an
end of text, so a reply is always as long as asked); what it proves is the
engine's real start, readiness, serving, metrics and death, not the text.

    python -m llmgw.testing.tinyhf OUT_DIR

It needs C{torch}, C{transformers} and C{tokenizers}, all of which vLLM
itself needs, so it is run with the interpreter vLLM is installed in.
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmgw.testing.tinygguf import CHAT_TEMPLATE

EMBEDDING = 64
LAYERS = 2
HEADS = 2
FEED_FORWARD = 128
CONTEXT = 512

SPECIAL = ["<unk>", "<s>", "</s>"]
_SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze", "bo", "da", "fi", "gu", "he"]


def words() -> list[str]:
    """
    The vocabulary's words, each with SentencePiece's word-start mark so that
    decoding puts a space before it: two-syllable made-up words.
    """
    return ["\u2581" + a + b for a in _SYLLABLES for b in _SYLLABLES]


def write(directory: str | Path, seed: int = 11) -> Path:
    """
    Write the model directory (created if need be); returns its path.

    @raise ImportError: C{torch}, C{transformers} or C{tokenizers} is missing.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + words())}

    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=CONTEXT)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=EMBEDDING, intermediate_size=FEED_FORWARD,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=CONTEXT, unk_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # Only the words can win: the special tokens' output rows are zero
        # and the words' rows large, so a reply is whole words, never an end
        # of text.
        head = model.lm_head.weight
        head[: len(SPECIAL)] = 0.0
        head[len(SPECIAL):] = torch.randn(len(vocab) - len(SPECIAL), EMBEDDING) * 2.0
    model.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m llmgw.testing.tinyhf OUT_DIR", file=sys.stderr)
        sys.exit(2)
    print(write(sys.argv[1]))
