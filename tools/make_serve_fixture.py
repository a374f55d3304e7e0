"""Makes tests/fixtures/hf/chat/: a tiny Llama checkpoint with a real tokenizer and chat template, and transformers' outputs.

Dev-only, like tools/make_hf_fixtures.py: needs torch, transformers and
tokenizers (`pip install -e '.[fixtures,generate]'`). The outputs are
committed, so the test suite needs none of them but `tokenizers`. Run from
the repository root:

    python tools/make_serve_fixture.py

What it writes:
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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
import torch
import transformers
from make_hf_fixtures import perturb  # tools/ is first on the path when this runs as a script
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf" / "chat"
VOCAB_SIZE = 384
SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
NEW_TOKENS = 24

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


def make_model(prompt: list[int]):
    """A perturbed random Llama whose greedy path from `prompt` varies and keeps a clear top-1 margin."""
    config = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, bos_token_id=SPECIALS.index("<|bos|>"),
                                      eos_token_id=SPECIALS.index("<|eos|>"))
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


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    train_tokenizer().save(str(OUT / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "<|eos|>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": eos,
         "chat_template": CHAT_TEMPLATE, "model_max_length": 512}, indent=1) + "\n")

    tokenizer = transformers.AutoTokenizer.from_pretrained(OUT)
    chats = []
    for messages, add_generation_prompt in CHATS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False)
        chats.append({"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                      "ids": list(ids)})
    texts = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        texts.append({"text": text, "ids": ids, "ids_without_special": tokenizer.encode(text, add_special_tokens=False),
                      "decoded": tokenizer.decode(ids, skip_special_tokens=True),
                      "decoded_with_special": tokenizer.decode(ids, skip_special_tokens=False)})

    prompt = chats[0]["ids"]
    model, new, gap = make_model(prompt)
    model.save_pretrained(OUT, safe_serialization=True)
    generation = transformers.GenerationConfig(bos_token_id=SPECIALS.index("<|bos|>"),
                                               eos_token_id=[SPECIALS.index("<|eos|>"), SPECIALS.index("<|end|>")])
    generation.save_pretrained(OUT)
    expected = {
        "vocab_size": VOCAB_SIZE,
        "special_tokens": {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS},
        "chats": chats,
        "texts": texts,
        "greedy": {"chat": 0, "prompt": prompt, "new_tokens": new, "min_top2_gap": gap,
                   "text": tokenizer.decode(new, skip_special_tokens=True)},
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    (OUT / "made_with.json").write_text(json.dumps(
        {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
         "distinct_greedy_tokens": len(set(new)), "min_top2_gap": gap}, indent=1) + "\n")
    size = sum(path.stat().st_size for path in OUT.iterdir())
    print(f"{OUT}: {size} bytes; prompt {len(prompt)} tokens; greedy {new} ({len(set(new))} distinct, gap {gap:.3f})")


if __name__ == "__main__":
    main()
