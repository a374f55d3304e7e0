"""Makes tests/fixtures/hf/{chat,sentencepiece}/: tiny Llama checkpoints with real tokenizers and chat templates.

Dev-only, like tools/make_hf_fixtures.py: needs torch, transformers and
tokenizers (`pip install -e '.[fixtures,generate]'`). The outputs are
committed, so the test suite needs none of them but `tokenizers`. Run from
the repository root, naming the fixtures to write:

    python tools/make_serve_fixture.py sentencepiece

`chat` trains its tokenizer on the repository's Markdown as it stands when
the script runs, so remaking it after the docs changed changes it (and the
tests' expectations with it); name only the fixture you mean to remake.

What it writes in `chat/`:
- `tokenizer.json`: a byte-level BPE of 384 tokens trained on the repository's
  own prose (README.md and docs/**/*.md as they stand when the script runs),
  six special tokens first (ids 0-5), BOS prepended to single sequences.
- `tokenizer_config.json`: BOS and EOS (EOS as an AddedToken dict, the older
  form checkpoints still carry) and a chat template with a loop, an `if`, a
  default system message and `raise_exception` for an unknown role.
- `config.json`, `model.safetensors`, `generation_config.json`: a random
  Llama of that vocabulary (weights perturbed as make_hf_fixtures does, so
  greedy decoding moves), EOS ids `<|eos|>` and `<|end|>`.
- `expected.json`: what transformers makes of it: rendered chats and their
  ids, encode/decode round trips, and 24 greedy tokens from a chat prompt.
- `made_with.json`: the versions that made it.

What it writes in `sentencepiece/`, the same files for a Llama-2/Mistral-style
tokenizer as their tokenizer.json has it:
- `tokenizer.json`: a BPE with byte fallback; `<unk>`, `<s>`, `</s>` at ids
  0-2, the pieces `<0x00>`..`<0xFF>` at 3-258, then 253 pieces trained on
  `SENTENCEPIECE_TEXT` (with `▁` for a space); the normalizer prepends `▁` and
  turns spaces into `▁`, the decoder turns them back and strips the first
  space, the post-processor prepends `<s>`.
- `tokenizer_config.json`, `generation_config.json` (EOS `</s>`), `config.json`,
  `model.safetensors`, `expected.json`, `made_with.json` as in `chat/`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from make_hf_fixtures import perturb  # tools/ is first on the path when this runs as a script
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
NEW_TOKENS = 24

# chat/: a byte-level BPE with chat-style special tokens.
VOCAB_SIZE = 384
SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Rendered with trim_blocks and lstrip_blocks, as transformers renders: block tags and their indentation print
# nothing, `{{-` drops the indentation before an output, and each message ends with the newline after its `}}`.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
        {{- '<|system|>You are a helpful assistant.<|end|>' }}
    {% endif %}
    {{- '<|' + message['role'] + '|>' + message['content'] | trim + '<|end|>' }}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|assistant|>' }}
{% endif %}"""

CHATS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "What is a KV cache?"},
      {"role": "assistant", "content": "Saved keys and values."},
      {"role": "user", "content": "Ünïcödé? 日本語 😀"}], True),
    ([{"role": "user", "content": "  padded, with a newline\n"},
      {"role": "assistant", "content": "Trimmed."}], False),
]
TEXTS = [
    "Hello, world!",
    "héllo wörld — ünïcödé ≥ 2×",
    "日本語のテキスト 😀🎉 and emoji",
    "  leading spaces\nnew lines\tand tabs  ",
    "<|user|>special tokens in text<|end|>",
]

# sentencepiece/: Llama-2's layout, `<unk>` `<s>` `</s>` then the 256 byte pieces, then trained pieces.
SENTENCEPIECE_SPECIALS = ["<unk>", "<s>", "</s>"]
SENTENCEPIECE_VOCAB_SIZE = 512
# ASCII only, so that every other character is spelled in byte pieces; "have", "w", "121" and "but" recur so that
# "▁have ▁w 121 ▁but" are pieces (the text the tests read back).
SENTENCEPIECE_TEXT = """\
We have w121 but at the end of the day the cache holds what we have seen.
A key and a value for every token: the cache keeps them, so the next step reads but does not recompute them.
We have 121 keys, but at step 122 we have one more; the window w121 slides but the pages stay.
Paged attention reads blocks of sixteen slots, and a block table maps each sequence to its blocks.
The server batches requests that arrive at different times, and each step decodes one token for each of them.
Stop strings end a reply: the text is cut where they begin, and what could still become one is held back.
What we have in the prompt stays; what the model writes is streamed to the client, a few characters at a time.
"""
# Mistral-7B-Instruct's template, with Llama-2's spaces: a user turn in [INST] tags, a reply ended by `</s>`.
SENTENCEPIECE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")
SENTENCEPIECE_CHATS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "user", "content": "What is a KV cache?"},
      {"role": "assistant", "content": "Saved keys and values."},
      {"role": "user", "content": "Ünïcödé? 日本語 😀"}], True),
]
SENTENCEPIECE_TEXTS = [
    "have w121 but at",
    "Hello, world!",
    "héllo wörld — ünïcödé ≥ 2×",
    "日本語のテキスト 😀🎉 and emoji",
    "  leading spaces\nnew lines\tand tabs  ",
    "</s> special tokens in text <s>",
]


def train_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE on the repository's Markdown, BOS prepended to single sequences."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((path.read_text(encoding="utf-8") for path in sources), trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                             special_tokens=[("<|bos|>", bos)])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    return tokenizer


def sentencepiece_normalizer() -> normalizers.Normalizer:
    """Llama-2's: a `▁` before the text and in place of every space."""
    return normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])


def train_sentencepiece_tokenizer() -> tokenizers.Tokenizer:
    """A Llama-2-style BPE with byte fallback, its pieces trained on `SENTENCEPIECE_TEXT`."""
    trainer_tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.normalizer = sentencepiece_normalizer()
    # Only while training: pieces never cross a word's start, and a run of digits is a word (so "121" is a piece).
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("▁", "merged_with_next"),
                                                               pre_tokenizers.Digits()])
    learned_size = SENTENCEPIECE_VOCAB_SIZE - 256
    trainer = trainers.BpeTrainer(vocab_size=learned_size, special_tokens=SENTENCEPIECE_SPECIALS, show_progress=False)
    trainer_tokenizer.train_from_iterator(SENTENCEPIECE_TEXT.splitlines(), trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    assert len(trained["vocab"]) == learned_size, len(trained["vocab"])
    pieces = sorted((piece for piece in trained["vocab"] if piece not in SENTENCEPIECE_SPECIALS),
                    key=trained["vocab"].get)
    vocab = SENTENCEPIECE_SPECIALS + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    tokenizer = tokenizers.Tokenizer(models.BPE(
        vocab={piece: index for index, piece in enumerate(vocab)}, merges=[tuple(pair) for pair in trained["merges"]],
        unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.add_special_tokens([tokenizers.AddedToken(token, normalized=False, special=True)
                                  for token in SENTENCEPIECE_SPECIALS])
    tokenizer.normalizer = sentencepiece_normalizer()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 1)])
    assert tokenizer.get_vocab_size() == SENTENCEPIECE_VOCAB_SIZE, tokenizer.get_vocab_size()
    have = tokenizer.encode("have w121 but", add_special_tokens=False).tokens
    assert have == ["▁have", "▁w", "121", "▁but"], have
    return tokenizer


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """transformers' greedy continuation of `prompt` (never stopping early) and its smallest top-1/top-2 gap."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(prompt):].tolist()
        # The same path by hand: generate's processors must not have changed any step.
        sequence = list(prompt)
        for _ in range(NEW_TOKENS):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    assert sequence[len(prompt):] == new, (sequence[len(prompt):], new)
    top2 = torch.stack([step[0] for step in out.logits]).topk(2).values
    return new, float((top2[:, 0] - top2[:, 1]).min())


def make_model(prompt: list[int], vocab_size: int, bos_token_id: int, eos_token_id: int):
    """A perturbed random Llama whose greedy path from `prompt` varies and keeps a clear top-1 margin."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    config._attn_implementation = "eager"
    best = None
    for attempt in range(24):
        torch.manual_seed(attempt)
        model = transformers.LlamaForCausalLM(config).eval()
        perturb(model, torch.Generator().manual_seed(attempt), embed_scale=(1.0, 0.5)[attempt % 2],
                gain=(1.5, 3.0, 6.0)[attempt // 2 % 3])
        new, gap = greedy(model, prompt)
        score = min(len(set(new)), 12) + 10 * gap
        if best is None or score > best[0]:
            best = (score, model, new, gap)
        if len(set(new)) >= 10 and gap >= 0.05:
            break
    return best[1:]


def transformers_text(out: Path, chats, texts) -> tuple[object, list[dict], list[dict]]:
    """transformers' tokenizer from `out`, the chats it renders (text and ids) and its encode/decode round trips."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    rendered = []
    for messages, add_generation_prompt in chats:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False)
        rendered.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                         "ids": list(ids)})
    round_trips = []
    for text in texts:
        ids = tokenizer.encode(text)
        round_trips.append({"text": text, "ids": ids,
                            "ids_without_special": tokenizer.encode(text, add_special_tokens=False),
                            "decoded": tokenizer.decode(ids, skip_special_tokens=True),
                            "decoded_with_special": tokenizer.decode(ids, skip_special_tokens=False)})
    return tokenizer, rendered, round_trips


def write_model_and_expected(out: Path, tokenizer, chats: list[dict], texts: list[dict], specials: list[str],
                             vocab_size: int, bos_token_id: int, eos_token_ids: list[int]) -> None:
    """The random model (greedy from the first chat's prompt), generation_config.json, expected.json, made_with.json."""
    prompt = chats[0]["ids"]
    model, new, gap = make_model(prompt, vocab_size, bos_token_id, eos_token_ids[0])
    model.save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_ids[0] if len(eos_token_ids) == 1 else eos_token_ids,
                                  ).save_pretrained(out)
    expected = {
        "vocab_size": vocab_size,
        "special_tokens": {token: tokenizer.convert_tokens_to_ids(token) for token in specials},
        "chats": chats,
        "texts": texts,
        "greedy": {"chat": 0, "prompt": prompt, "new_tokens": new, "min_top2_gap": gap,
                   "text": tokenizer.decode(new, skip_special_tokens=True)},
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    (out / "made_with.json").write_text(json.dumps(
        {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
         "distinct_greedy_tokens": len(set(new)), "min_top2_gap": gap}, indent=1) + "\n")
    size = sum(path.stat().st_size for path in out.iterdir())
    print(f"{out}: {size} bytes; prompt {len(prompt)} tokens; greedy {new} ({len(set(new))} distinct, gap {gap:.3f})")


def make_chat() -> None:
    out = FIXTURES / "chat"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    train_tokenizer().save(str(out / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "<|eos|>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": eos,
         "chat_template": CHAT_TEMPLATE, "model_max_length": 512}, indent=1) + "\n")
    tokenizer, chats, texts = transformers_text(out, CHATS, TEXTS)
    write_model_and_expected(out, tokenizer, chats, texts, SPECIALS, VOCAB_SIZE, SPECIALS.index("<|bos|>"),
                             [SPECIALS.index("<|eos|>"), SPECIALS.index("<|end|>")])


def make_sentencepiece() -> None:
    out = FIXTURES / "sentencepiece"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    train_sentencepiece_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "chat_template": SENTENCEPIECE_CHAT_TEMPLATE, "model_max_length": 512}, indent=1) + "\n")
    tokenizer, chats, texts = transformers_text(out, SENTENCEPIECE_CHATS, SENTENCEPIECE_TEXTS)
    write_model_and_expected(out, tokenizer, chats, texts, SENTENCEPIECE_SPECIALS, SENTENCEPIECE_VOCAB_SIZE,
                             SENTENCEPIECE_SPECIALS.index("<s>"), [SENTENCEPIECE_SPECIALS.index("</s>")])


MAKERS = {"chat": make_chat, "sentencepiece": make_sentencepiece}


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(MAKERS))
    if not names or unknown:
        raise SystemExit(f"name the fixtures to make, of {sorted(MAKERS)}; got {names}")
    for name in names:
        MAKERS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
