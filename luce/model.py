"""`luce.load()`: a GGUF file, its family, a backend, a tokenizer and a chat template,
with a Python generation API on top."""
from __future__ import annotations

import os
import time
from typing import Iterator

from .backends import get_backend
from .engine.generator import Delta, Session, generate
from .engine.sampling import SamplingParams
from .errors import ModelFileError
from .gguf_file import GGUFFile
from .models.bundled import resolve_model
from .plugins import family_for
from .text.chat_template import TemplateError

DEFAULT_CTX = 4096
SYNTHETIC = "synthetic:"  # load()'s prefix for a random-weight model of a named shape


class Model:
    def __init__(self, path, backend="auto", n_ctx: int | None = None, progress: bool = False,
                 chat_template: str | None = None):
        from .kernels.dequant import SUPPORTED_TYPES
        from .text.chat_template import ChatTemplate
        from .text.tokenizer import Tokenizer

        t0 = time.perf_counter()
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        if isinstance(path, str) and path.startswith(SYNTHETIC):
            # a random-weight model of a real shape, made in memory (benchmarks of what needs
            # a whole Model: speculative decoding, the server), no file written or read
            from .bench.synthetic import SyntheticFile, synthetic_loader
            self.file = SyntheticFile(path[len(SYNTHETIC):])
            self.path, self._load_tensor = self.file.path, synthetic_loader(self.backend)
        else:
            self.path = resolve_model(path)
            self.file = GGUFFile(self.path)
            self.file.require_types(SUPPORTED_TYPES)
            self._load_tensor = self.backend.load_tensor
        self.family = family_for(self.path, self.file.architecture)
        self.config = self.family.read_config(self.file)
        try:
            self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
        except (KeyError, ValueError) as e:
            raise ModelFileError(self.path, f"bad tokenizer metadata ({e})") from None
        src = chat_template if chat_template is not None else self.file.get_str("tokenizer.chat_template")
        self.has_chat_template = src is not None
        bos, eos = self._token_text(self.tokenizer.bos_id), self._token_text(self.tokenizer.eos_id)
        try:
            self.chat_template = ChatTemplate(src, bos_token=bos, eos_token=eos) if src else \
                ChatTemplate.chatml(bos_token=bos)
            self.chat_template_error = None
        except TemplateError as e:
            # a hostile or broken template must not stop plain completions: chat fails, naming it
            self.chat_template, self.chat_template_error = None, f"{self.path}: chat template rejected ({e})"
        self.weights = self._load_weights(progress)
        if hasattr(self.backend, "warmup"):  # compile kernels now, not on the first request
            self.backend.warmup(self.family, self.config, self.weights)
        self.n_ctx = n_ctx or min(DEFAULT_CTX, self.config.n_ctx_train)
        self._session: Session | None = None
        self.load_s = time.perf_counter() - t0

    def _token_text(self, tid):
        return self.tokenizer.token_text(tid) if tid is not None else ""

    def _load_weights(self, progress: bool):
        from .models.transformer import build_weights, tensor_names
        names = tensor_names(self.config)
        plan = getattr(self.backend, "plan_weights", None)  # a backend that lays weights out by the whole model
        if plan is not None:
            plan(self.file.tensors, self.config.tied_output)
        if not progress:
            return build_weights(self.config, self.file, self._load_tensor)
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        with Progress(TextColumn(f"loading {self.path.name}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task("load", total=len(names))

            def load(info):
                out = self._load_tensor(info)
                bar.advance(task)
                return out
            return build_weights(self.config, self.file, load)

    # -- low level ------------------------------------------------------------------
    def forward(self, cache, tokens, positions, mask=None, logits_rows=None):
        return self.backend.forward(self.family, self.config, self.weights, cache, tokens, positions, mask=mask,
                                    logits_rows=logits_rows)

    def forward_greedy(self, cache, tokens, positions, mask=None):
        """forward's rows as GreedyRows (luce.backends): argmaxes at once, logits on demand;
        on the device where the backend can (CUDABackend.forward_greedy)."""
        fn = getattr(self.backend, "forward_greedy", None)
        if fn is not None:
            return fn(self.family, self.config, self.weights, cache, tokens, positions, mask=mask)
        from .backends import greedy_rows
        return greedy_rows(self.forward(cache, tokens, positions, mask=mask))

    def queue_greedy(self, cache, tokens, positions, mask=None):
        """forward_greedy queued: `.result()` gives its GreedyRows. On a backend that queues
        (CUDABackend.queue_greedy) this returns before the GPU is done, so work on another
        model's stream can run beside it; elsewhere the forward runs here."""
        fn = getattr(self.backend, "queue_greedy", None)
        if fn is not None:
            return fn(self.family, self.config, self.weights, cache, tokens, positions, mask=mask)
        return _Done(self.forward_greedy(cache, tokens, positions, mask=mask))

    def forward_next_token(self, cache, token, position, sample=None):
        """Queue a one-token decode step whose next token (greedy, or drawn with `sample`)
        stays on the device (backends with `forward_next_token`): see
        CUDABackend.forward_next_token."""
        if sample is None:  # a plugin's backend may predate `sample`: greedy asks it nothing new
            return self.backend.forward_next_token(self.family, self.config, self.weights, cache, token, position)
        return self.backend.forward_next_token(self.family, self.config, self.weights, cache, token, position,
                                               sample=sample)

    def forward_topk(self, cache, token, position, k: int, rows: int = 1):
        """A greedy step (token: one, None, or a list at positions position..) whose last
        row's (or last `rows` rows') k best candidates and log-probabilities come back
        without the logits (backends with `forward_topk`: see CUDABackend.forward_topk)."""
        if rows == 1:  # a plugin's backend may predate rows
            return self.backend.forward_topk(self.family, self.config, self.weights, cache, token, position, k)
        return self.backend.forward_topk(self.family, self.config, self.weights, cache, token, position, k,
                                         rows=rows)

    def begin_chain(self, cache, k: int, log_p_min: float) -> bool:
        """Start a draft's chain on the device for forward_topk's steps (backends with
        `begin_chain`: see CUDABackend.begin_chain); False where the steps queued past its
        stop would still run (or there is no such chain)."""
        begin = getattr(self.backend, "begin_chain", None)
        return bool(begin is not None and begin(self.family, self.config, self.weights, cache, k, log_p_min))

    def set_penalty_history(self, cache, history, repeat_last_n: int) -> None:
        """The history that forward_next_token's draws with penalties penalize (backends
        with device sampling): see CUDABackend.set_penalty_history."""
        self.backend.set_penalty_history(self.family, self.config, self.weights, cache, history, repeat_last_n)

    def new_session(self, n_ctx: int | None = None) -> Session:
        return Session(self, n_ctx or self.n_ctx)

    @property
    def session(self) -> Session:
        """The model's default session: its cache is reused across calls (prefix caching)."""
        if self._session is None:
            self._session = self.new_session()
        return self._session

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def sampling_params(self, **kw) -> SamplingParams:
        base = SamplingParams().with_(**self.family.sampling_defaults)
        return base.with_(**kw)

    def render_chat(self, messages, tools=None, add_generation_prompt=True, **extra) -> str:
        if self.chat_template is None:
            raise TemplateError(self.chat_template_error)
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)

    def chat_prompt_ids(self, messages, tools=None, **extra) -> list[int]:
        text = self.render_chat(messages, tools=tools, **extra)
        # the template writes BOS itself where the model wants one
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    # -- generation -----------------------------------------------------------------
    def stream(self, prompt, session: Session | None = None, stepper=None, **params) -> Iterator[Delta]:
        """Deltas of a completion of `prompt` (text or token ids)."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return generate(session or self.session, ids, self.sampling_params(**params), stepper=stepper)

    def generate(self, prompt, stream: bool = False, **params):
        """The completion of `prompt` as a string, or an iterator of text pieces with stream=True."""
        deltas = self.stream(prompt, **params)
        if stream:
            return (d.text for d in deltas if d.text)
        return "".join(d.text for d in deltas)

    def chat(self, messages, tools=None, stream: bool = False, **params):
        ids = self.chat_prompt_ids(messages, tools=tools)
        return self.generate(ids, stream=stream, **params)


def load(model: str | os.PathLike | None = None, backend: str = "auto", n_ctx: int | None = None,
         progress: bool = False, chat_template: str | None = None) -> Model:
    """Load a GGUF model: a path, a Hugging Face `owner/repo:file.gguf`, None for the bundled
    SmolLM2-135M, or `synthetic:NAME` for random weights of a real model's shape
    (luce.bench.synthetic.SHAPES: qwen3-8b, qwen3-0.6b, ...), made in memory."""
    return Model(model, backend=backend, n_ctx=n_ctx, progress=progress, chat_template=chat_template)


class _Done:
    """A result already computed, behind the pending results' `.result()`."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value
