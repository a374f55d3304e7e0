"""The checkpoint `python -m benchmarks.serve` serves: `benchmarks.model`'s random 125M Llama, with a tokenizer.

Both servers load the same directory, so it holds what each needs:

  config.json, model.safetensors  `write_llama_checkpoint`'s random float32
                                  Llama (`LLAMA_125M`), plus the bos/eos ids
  generation_config.json          greedy, the same eos id
  tokenizer.json                  a byte-level BPE trained with `tokenizers`
                                  on the repository's own text, filled up to
                                  the model's vocabulary with added tokens
                                  `[extra_N]`, so every id the model can
                                  emit decodes to text
  tokenizer_config.json           bos/eos tokens and a small chat template

The repository's text alone yields about 10k merges, fewer than the
32000-token vocabulary; the added tokens fill the rest. A random model emits
about uniform ids, so most of its output is those added tokens: harmless for
timing, and they are never special, so no server skips them when it streams
(nor named `<|...|>`, which llama.cpp's GGUF converter takes for control
tokens, which llama-server does not print).
The eos token is one id of 32000, so a random model rarely stops early;
the harness reports the output token counts it got.

The directory is written once and reused while `serve_checkpoint.json`
(the sizes, the seed and the tokenizer's hash) says it holds what was asked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from benchmarks.model import LLAMA_125M, write_llama_checkpoint

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "corpus", "kept_corpus", "load_tokenizer", "train_tokenizer",
           "write_serve_checkpoint"]

REPO = Path(__file__).resolve().parents[1]
SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS = SPECIAL_TOKENS[:2]
# Roles as special tokens, so a rendered conversation splits the same way on every server.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def corpus(root: str | os.PathLike = REPO) -> list[str]:
    """The repository's prose and code (`*.md` and `*.py` under docs, src and benchmarks, and the README), in path order."""
    root = Path(root)
    paths = [root / "README.md"] if (root / "README.md").exists() else []
    for folder in ("docs", "src", "benchmarks"):
        paths += sorted(p for p in (root / folder).rglob("*") if p.suffix in (".md", ".py") and p.is_file())
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def kept_corpus(cache: str | os.PathLike) -> str:
    """`corpus()` joined as it was when `cache` first asked for it, kept there (`corpus.txt`).

    The benchmark's prompts are windows of this text: kept, the runs that share a cache send the same requests
    however the repository's docs and code change between them.
    """
    path = Path(cache) / "corpus.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text("\n".join(corpus()), encoding="utf-8")
        os.replace(partial, path)
    return path.read_text(encoding="utf-8")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` ids, trained on `texts`; added tokens `[extra_N]` fill the rest.

    Ids 0..4 are `SPECIAL_TOKENS`, in order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    trained = tokenizer.get_vocab_size()
    if trained < vocab_size:
        tokenizer.add_tokens([f"[extra_{i}]" for i in range(vocab_size - trained)])
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} ids, the model {vocab_size}")
    return tokenizer


def load_tokenizer(checkpoint: str | os.PathLike):
    """The checkpoint's `tokenizer.json`, as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_serve_checkpoint(directory: str | os.PathLike, *, sizes: dict[str, int] | None = None,
                           max_position_embeddings: int = 2048, seed: int = 0) -> dict[str, Any]:
    """Writes (or reuses) the served checkpoint under `directory`.

    Args:
      directory: created if missing; reused when its `serve_checkpoint.json` matches.
      sizes: `write_llama_checkpoint`'s sizes (default `LLAMA_125M`).
      max_position_embeddings: the longest sequence either server may hold.
      seed: the weights' seed.

    Returns:
      What `serve_checkpoint.json` records: the sizes, the seed and the hashes of the weights and tokenizer.
    """
    directory = Path(directory)
    wanted = dict(sizes or LLAMA_125M, max_position_embeddings=max_position_embeddings, seed=seed)
    stamp = directory / "serve_checkpoint.json"
    if stamp.exists():
        recorded = json.loads(stamp.read_text())
        if recorded.get("wanted") == wanted:
            return recorded
    write_llama_checkpoint(directory, **wanted)
    tokenizer = train_tokenizer(corpus(), wanted["vocab_size"])
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {"bos_token_id": tokenizer.token_to_id(BOS), "eos_token_id": tokenizer.token_to_id(EOS)}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **ids}, indent=2) + "\n")
    generation = {**ids, "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": max_position_embeddings, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    recorded = {
        "wanted": wanted, "tokens_from_training": len(tokenizer.get_vocab(with_added_tokens=False)),
        "sha256": {name: _sha256(directory / name) for name in ("model.safetensors", "tokenizer.json")},
    }
    stamp.write_text(json.dumps(recorded, indent=2) + "\n")
    return recorded
