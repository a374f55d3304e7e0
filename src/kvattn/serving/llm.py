"""`LLM`: the offline face of the serving engine: prompts in, text out, continuous batching underneath.

`LLM(checkpoint)` loads a Hugging Face checkpoint as a paged model under the
same `Server` that `kvattn serve` runs, so both faces sample, speculate,
check and stop alike. `generate` takes one prompt or many (text or token
ids) and returns, per prompt, each completion's text, ids, finish reason and
(if asked) log-probabilities; `chat` renders conversations through the
checkpoint's template first; `stream` yields one completion's text as it is
produced. Calls are independent: nothing but the prefix cache (which only
saves work) outlives one. The names are vLLM's (`LLM`, `SamplingParams`,
`RequestOutput`, `CompletionOutput`), so code moves between the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import numpy as np

from kvattn.caches.base import blocks_spanned
from kvattn.extra import loading_progress, progress_bar, require
from kvattn.generation.sampling import SamplingParams
from kvattn.generation.drafters import PromptLookup
from kvattn.models.hf import checkpoint_config, eos_token_ids, from_pretrained
from kvattn.serving.requests import Completion, Token
from kvattn.serving.server import DEFAULT_CHUNK_PAGES, Server

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    """Which of the prompt's `n` completions."""
    text: str | None
    """Its text, cut before a stop string (None for a checkpoint without a tokenizer)."""
    token_ids: list[int]
    """The new token ids, an end-of-sequence or stop id included."""
    finish_reason: str
    """`"stop"` (an end-of-sequence or stop id, or a stop string) or `"length"` (`max_tokens`)."""
    logprobs: list[Token] | None = None
    """With `SamplingParams.logprobs`: each new token's id, log-probability and most likely alternatives."""


@dataclasses.dataclass
class RequestOutput:
    """What `LLM.generate` returns for one prompt."""

    prompt: str | None
    """The prompt's text (None when it was given as ids)."""
    prompt_token_ids: list[int]
    """The prompt's token ids (a text prompt as the tokenizer encodes it, special tokens included)."""
    outputs: list[CompletionOutput]
    """Its `n` completions, in order."""


class _Choice:
    """One completion while it runs: its tokens, and its text through the tokenizer's `TextStream`."""

    def __init__(self, llm: LLM, prompt: list[int], params: SamplingParams):
        self.tokens: list[Token] = []
        self.text: list[str] = []
        self.stream = None
        if llm.tokenizer is not None:
            from kvattn.serving.text import TextStream  # with the tokenizer's extra

            self.stream = TextStream(llm.tokenizer, prompt=prompt, stop=params.stop,
                                     stop_token_ids=params.stop_ids(llm.eos_token_ids),
                                     skip_special_tokens=params.skip_special_tokens,
                                     include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.stopped = False  # by a stop string

    def add(self, token: Token) -> str:
        """Records `token`; returns the text it adds."""
        self.tokens.append(token)
        if self.stream is None:
            return ""
        delta = self.stream.push(token.id)
        self.stopped = delta.stopped
        self.text.append(delta.text)
        return delta.text

    def finish(self) -> str:
        if self.stream is None:
            return ""
        delta = self.stream.finish()
        self.text.append(delta.text)
        return delta.text

    def output(self, index: int, completion: Completion, params: SamplingParams) -> CompletionOutput:
        reason = "stop" if self.stopped else completion.finish_reason
        return CompletionOutput(index, None if self.stream is None else "".join(self.text),
                                [t.id for t in self.tokens], reason,
                                list(self.tokens) if params.logprobs is not None else None)


class LLM:
    """A checkpoint under the continuous-batching engine, for offline batches: prompts in, text out.

    Args:
      checkpoint: a Hugging Face checkpoint directory (`config.json`,
        `model.safetensors`; `tokenizer.json` for text, `generation_config.json`
        for the end-of-sequence ids).
      weights: None for float weights, `"int8"` or `"int4"` for int8 or
        4-bit weights, `"bfloat16"` for bfloat16 ones (see `kvattn.models.from_pretrained`).
      dtype: computation dtype (default float32).
      max_len: tokens per sequence, prompt and completion (default: the
        model's trained context, `max_position_embeddings`).
      allow_long_context: accept a `max_len` past the trained context (a
        model degrades or fails there; refused otherwise).
      max_batch: sequences decoded together.
      page_size: cache slots per page.
      num_pages: pages in the pool (default: room for `max_batch` sequences
        at `max_len`, plus one).
      chunk: prefill chunk in tokens (default: `DEFAULT_CHUNK_PAGES` pages).
      prefix_caching: share the pages of equal prompt prefixes between requests.
      speculative: a `kvattn.generation.PromptLookup`: draft by lookup,
        verify in one call; the output is unchanged.
      seed: draws the seed of each request whose `SamplingParams` names none.
      progress: show a progress bar over the checkpoint's tensors while they
        load (with tqdm installed).

    Example:
      >>> from kvattn import LLM, SamplingParams
      >>> llm = LLM("tests/fixtures/hf/chat", max_len=64, max_batch=2)
      >>> [out] = llm.generate("The cache", SamplingParams(max_tokens=8))
      >>> len(out.outputs[0].token_ids), out.outputs[0].finish_reason
      (8, 'length')
    """

    def __init__(self, checkpoint, *, weights: str | None = None, dtype=None, max_len: int | None = None,
                 allow_long_context: bool = False, max_batch: int = 8, page_size: int = 16,
                 num_pages: int | None = None, chunk: int | None = None, prefix_caching: bool = True,
                 speculative: PromptLookup | None = None, seed: int | None = None, progress: bool = True):
        path = Path(checkpoint)
        model_config = checkpoint_config(path)
        context = model_config.max_position_embeddings
        self.tokenizer = None
        """The checkpoint's `kvattn.serving.tokenizer.Tokenizer`, or None without a `tokenizer.json` (ids only)."""
        if (path / "tokenizer.json").is_file():
            require("tokenizers", extra_name="generate")
            require("jinja2", extra_name="generate")
            from kvattn.serving.tokenizer import Tokenizer  # tokenizers and jinja2: only for a checkpoint with text

            self.tokenizer = Tokenizer.from_directory(path)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None and self.tokenizer.eos_token_ids else \
            eos_token_ids(path)
        self.eos_token_ids = frozenset(i for i in eos if i < model_config.vocab_size)  # an id past the vocabulary never comes
        """The ids that end a completion unless `ignore_eos` (`generation_config.json`, else `config.json`)."""
        self.max_len = context if max_len is None else int(max_len)
        """Tokens per sequence, prompt and completion."""
        if self.max_len > context and not allow_long_context:
            raise ValueError(f"max_len {self.max_len} is past the model's trained context of {context} tokens "
                             "(max_position_embeddings); pass allow_long_context=True to use it anyway")
        chunk = chunk or DEFAULT_CHUNK_PAGES * page_size
        pages = num_pages or max_batch * blocks_spanned(self.max_len, page_size) + 1
        model = from_pretrained(path, max_len=self.max_len, batch_size=max_batch, dtype=dtype, weights=weights,
                                num_pages=pages, page_size=page_size,
                                on_tensor=loading_progress() if progress else None)
        self.config = model.config
        """The model's `ModelConfig`."""
        self.engine = Server(model, chunk=chunk, prefix_caching=prefix_caching, speculative=speculative,
                             rng=None if seed is None else jax.random.key(seed), donate_pools=True)  # ours alone
        """The `kvattn.serving.Server` every call runs on."""
        self._grammars = None  # structured outputs' compiler, made at the first request that has them

    # ---------------------------------------------------------------- checks

    def _prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        """Each prompt as `(text or None, ids)`: a string, a list of strings, token ids, or a list of those."""
        if isinstance(prompts, str) or _is_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not prompts:
            raise TypeError(f"prompts must be a string, token ids, or a non-empty list of those, got {prompts!r:.80}")
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need the checkpoint's tokenizer.json; pass token ids instead")
                out.append((prompt, self.tokenizer.encode(prompt, add_special_tokens=True)))
            elif _is_ids(prompt):
                out.append((None, [int(i) for i in prompt]))
            else:
                raise TypeError(f"a prompt must be a string or a list of token ids, got {prompt!r:.80}")
        return out

    def _checked(self, prompts, params) -> list[tuple[str | None, list[int], SamplingParams, object]]:
        """Every prompt with its params and its compiled structured outputs (or None), each checked before any
        is submitted."""
        prompts = self._prompts(prompts)
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"params must be a SamplingParams or a list of {len(prompts)} (one per prompt)")
        grammars = []
        for number, ((_, ids), request) in enumerate(zip(prompts, params)):
            try:  # the engine's own checks, all of them before anything is submitted
                self.engine.check(ids, request, eos_token_ids=self.eos_token_ids)
                grammars.append(self._grammar(request))
            except (TypeError, ValueError) as error:
                raise type(error)(f"prompt {number} ({len(ids)} tokens): {error}") from None
        return [(text, ids, request, grammar) for (text, ids), request, grammar in zip(prompts, params, grammars)]

    def _grammar(self, params: SamplingParams):
        """`params.structured_outputs` compiled for the tokenizer (`kvattn.serving.structured`), or None."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer.json")
        if self._grammars is None:
            require("llguidance", extra_name="generate")
            from kvattn.serving.structured import Grammars  # llguidance: only for structured outputs

            self._grammars = Grammars(self.tokenizer)
        return self._grammars.compile(params.structured_outputs)

    # ------------------------------------------------------------ generation

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = True) -> list[RequestOutput]:
        """Completes every prompt, all of them through continuous batching; one `RequestOutput` per prompt.

        Args:
          prompts: a string, a list of token ids, or a list of either.
          params: one `SamplingParams` for every prompt, or one per prompt
            (default: `SamplingParams()`, 16 greedy tokens).
          progress: show a progress bar over the completions of a batch (with tqdm installed).

        Raises:
          ValueError, TypeError: a prompt or setting that cannot run (before anything is submitted).
        """
        work = self._checked(prompts, params)
        choices: dict[int, _Choice] = {}
        firsts = []
        try:
            for _, ids, request, grammar in work:
                first = self.engine.submit(ids, request, eos_token_ids=self.eos_token_ids, grammar=grammar,
                                           on_token=lambda index, token: choices[index].add(token))
                firsts.append(first)
                choices.update({first + i: _Choice(self, ids, request) for i in range(request.n)})
            completions = self._run(choices, progress and len(choices) > 1)
        except BaseException:
            for index in choices:  # nothing of this call stays queued or running
                self.engine.abort(index)
            raise
        outputs = []
        for first, (text, ids, request, _) in zip(firsts, work):
            done = []
            for i in range(request.n):
                choices[first + i].finish()
                done.append(choices[first + i].output(i, completions[first + i], request))
            outputs.append(RequestOutput(text, ids, done))
        return outputs

    def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             progress: bool = True, tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`generate` for conversations, each rendered through the checkpoint's chat template.

        Args:
          messages: one conversation (a list of `{"role", "content"}`
            dicts) or a list of them.
          params, progress: as in `generate`.
          tools: tools' JSON schemas (OpenAI's `{"type": "function",
            "function": {...}}`), rendered by the template.
          add_generation_prompt: end with the header of the assistant's reply.
          continue_final_message: continue the last message instead (with
            `add_generation_prompt=False`).
          chat_template_kwargs: more variables for the template.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json and chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(self.tokenizer.render_chat(
            list(c), add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
            template_kwargs=chat_template_kwargs), add_special_tokens=False) for c in conversations]
        outputs = self.generate(prompts, params, progress=progress)
        for output, conversation in zip(outputs, conversations):
            output.prompt = self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
        return outputs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields one completion's text as it is produced (the same tokens `generate` gives it).

        The prompt and settings are checked at the call; the request is
        submitted when iteration starts and aborted if the caller stops early.

        Args:
          prompt: a string or token ids.
          params: its `SamplingParams` (`n` must be 1).
        """
        if self.tokenizer is None:
            raise ValueError("stream yields text: it needs the checkpoint's tokenizer.json")
        [(_, ids, request, grammar)] = self._checked([prompt], params)
        if request.n != 1:
            raise ValueError(f"stream yields one completion: n must be 1, got {request.n}")
        return self._stream(ids, request, grammar)

    def _stream(self, ids: list[int], request: SamplingParams, grammar) -> Iterator[str]:
        choice = _Choice(self, ids, request)
        pending: list[str] = []
        index = self.engine.submit(ids, request, eos_token_ids=self.eos_token_ids, grammar=grammar,
                                   on_token=lambda _, token: pending.append(choice.add(token)))
        finished = False
        try:
            while not finished:
                finished = any(c.request == index for c in self.engine.step())
                if choice.stopped and not finished:
                    finished = self.engine.abort(index) is not None
                yield from filter(None, pending)
                pending.clear()
            if tail := choice.finish():
                yield tail
        finally:
            if not finished:
                self.engine.abort(index)

    def _run(self, choices: dict[int, _Choice], progress: bool) -> dict[int, Completion]:
        """Steps the engine until every request of `choices` has finished; one that completes a stop string
        is ended at once."""
        bar = progress_bar(len(choices), "completions", "req") if progress else None
        completions: dict[int, Completion] = {}
        try:
            while len(completions) < len(choices):
                if self.engine.idle:
                    raise RuntimeError(f"the engine went idle with requests unfinished: "
                                       f"{sorted(choices.keys() - completions.keys())[:8]}")
                finished = list(self.engine.step())
                finished += [self.engine.abort(i) for i, c in choices.items() if c.stopped and i not in completions]
                for completion in filter(None, finished):
                    completions[completion.request] = completion
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return completions


def _is_ids(value) -> bool:
    """Whether `value` is one prompt of token ids (a list or 1-D array of ints)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and np.issubdtype(value.dtype, np.integer)
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in value))
