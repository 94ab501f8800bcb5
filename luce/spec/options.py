"""The speculative-decoding options every command shares (--spec, --draft, --ddtree-budget,
--draft-max), and turning them into a drafter and a stepper for a loaded target."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import LuceError

SPEC_MODES = ("off", "chain", "ddtree", "lookup")
DEFAULT_BUDGET = 22
# A draft of up to 12 tokens that stops where its chain's probability under the draft falls
# below 0.4: on the Qwen2.5-Coder 0.5B -> 1.5B pair over 128 tokens a code prompt, 8.26
# tokens a target forward for 8.66 draft forwards, against 7.01 for 8 at a fixed depth 8;
# at the GPU's costs (H100: ~5.9 ms a target forward + ~1.03 ms a draft step on the
# Qwen3-8B shape, ~22 + 1.0 on the 32B) a projected 1.74x / 3.52x plain decode against
# 1.55x / 3.05x (docs/benchmarks.md, forty-sixth session).
DEFAULT_DRAFT_MAX = 12
DEFAULT_P_MIN = 0.4
# What `luce bench --spec` drafts unless told: the depth the pair's acceptance is tabled at
# for every mode, at p-min 0, so that a random-weight run measures a full draft's cost
BENCH_DRAFT_MAX = 8
DEFAULT_TOP_K = 8
DEFAULT_DRAFT_AHEAD = 0  # draft steps queued beside a verification forward (DraftModel.queue_ahead)
DRAFT_MAX_AUTO = 0  # --draft-max auto: each step's depth chosen from the steps before it (luce.spec.depth)


@dataclass(frozen=True)
class SpecOptions:
    """mode: off | chain | ddtree | lookup (lookup: prompt n-gram drafts, chain verification).
    draft: a GGUF path, `repo:file`, or "auto" (the target family's declared draft).
    chain and ddtree without a usable draft model fall back to prompt lookup."""
    mode: str = "off"
    draft: str | None = None
    ddtree_budget: int = DEFAULT_BUDGET
    draft_max: int = DEFAULT_DRAFT_MAX  # DRAFT_MAX_AUTO: chosen a step (luce.spec.depth)
    top_k: int = DEFAULT_TOP_K
    draft_p_min: float = DEFAULT_P_MIN  # DraftModel's p_min: stop drafting where the chain gets this unlikely
    # draft steps queued beside each verification (DraftModel.queue_ahead); 0: none
    draft_ahead: int = DEFAULT_DRAFT_AHEAD
    # the draft model's chain seeded by prompt lookup (DraftModel.lookup): off until its
    # seeded catch-up has been timed on a GPU
    draft_lookup: bool = False

    def __post_init__(self):
        if self.mode not in SPEC_MODES:
            raise LuceError(f"--spec must be one of {', '.join(SPEC_MODES)}, not {self.mode!r}")
        if self.ddtree_budget < 1 or self.draft_max < 0 or self.top_k < 1:
            raise LuceError("--ddtree-budget, --draft-max (or auto) and the draft top-k must be >= 1")
        if self.draft_ahead < 0:
            raise LuceError(f"--draft-ahead must be >= 0, not {self.draft_ahead}")
        if self.draft_ahead and self.draft_p_min > 0:
            # a cut-off draft reads each step before queuing far ahead: nothing would be queued
            raise LuceError("--draft-ahead needs --draft-p-min 0")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise LuceError(f"--draft-p-min must be in [0, 1), not {self.draft_p_min}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def draft_max_label(self):
        """draft_max as the options spell it: a number, or "auto"."""
        return draft_max_label(self.draft_max)

    @property
    def method(self) -> str:
        return "ddtree" if self.mode == "ddtree" else "chain"

    @classmethod
    def from_cli(cls, spec: str | None, draft: str | None, ddtree_budget: int | None = None,
                 draft_max: int | str | None = None, draft_p_min: float | None = None,
                 draft_ahead: int | None = None, draft_lookup: bool = False) -> "SpecOptions":
        # naming a draft is asking for speculation: DDTree unless said otherwise
        mode = spec or ("ddtree" if draft else "off")
        return cls(mode=mode, draft=draft, ddtree_budget=ddtree_budget or DEFAULT_BUDGET,
                   draft_max=parse_draft_max(draft_max),
                   draft_p_min=DEFAULT_P_MIN if draft_p_min is None else draft_p_min,
                   draft_ahead=DEFAULT_DRAFT_AHEAD if draft_ahead is None else draft_ahead,
                   draft_lookup=bool(draft_lookup))


def draft_max_label(draft_max: int):
    """A draft max as the options spell it: a number, or "auto"."""
    return "auto" if draft_max == DRAFT_MAX_AUTO else draft_max


def parse_draft_maxes(value) -> tuple[int, ...]:
    """A comma-separated list of draft maxes (a bench's sweep), each as parse_draft_max."""
    items = [v for v in str(value).split(",") if v.strip()] if value is not None else [None]
    if not items:
        raise LuceError(f"--draft-max must be a number >= 1 or auto, not {value!r}")
    return tuple(dict.fromkeys(parse_draft_max(v) for v in items))


def parse_draft_max(value) -> int:
    """--draft-max's value: None -> the default, "auto" -> DRAFT_MAX_AUTO, else a number >= 1."""
    if value is None:
        return DEFAULT_DRAFT_MAX
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return DRAFT_MAX_AUTO
        try:
            value = int(value)
        except ValueError:
            raise LuceError(f"--draft-max must be a number >= 1 or auto, not {value!r}") from None
    if value < 1:
        raise LuceError(f"--draft-max must be a number >= 1 or auto, not {value!r}")
    return int(value)


DRAFT_AHEAD_HELP = ("draft steps queued beside each verification forward, guessing that the target keeps the "
                    "whole draft and then the draft's own next token; with --draft-p-min 0 only (0: none) "
                    f"[{DEFAULT_DRAFT_AHEAD}]")


def spec_options(f):
    """click decorator: adds spec, draft, ddtree_budget, draft_max, draft_p_min, draft_ahead,
    draft_lookup keyword arguments; `SpecOptions.from_cli(spec, draft, ddtree_budget,
    draft_max, draft_p_min, draft_ahead, draft_lookup)` turns them into options."""
    import click
    opts = [
        click.option("--spec", type=click.Choice(SPEC_MODES), default=None,
                     help="speculative decoding: chain or ddtree verification of a draft model's guesses, "
                          "or lookup (prompt n-grams, no model); default ddtree when --draft is given, else off"),
        click.option("--draft", default=None, metavar="PATH|auto",
                     help="draft model sharing the target's tokenizer; auto: the one the model family declares"),
        click.option("--ddtree-budget", type=int, default=None,
                     help=f"DDTree node budget per target forward [{DEFAULT_BUDGET}]"),
        click.option("--draft-max", default=None, metavar="N|auto",
                     help=f"longest draft (tokens drafted per step, the tree's depth); auto: chosen each step "
                          f"from what drafting and verifying cost and how much the target kept [{DEFAULT_DRAFT_MAX}]"),
        click.option("--draft-p-min", type=float, default=None,
                     help="stop a draft where its chain's probability under the draft model falls below this "
                          f"(0: always draft --draft-max tokens) [{DEFAULT_P_MIN}]"),
        click.option("--draft-ahead", type=int, default=None, metavar="N", help=DRAFT_AHEAD_HELP),
        click.option("--draft-lookup", is_flag=True, default=False,
                     help="guess the draft model's next tokens by prompt lookup and check the guess in its "
                          "catch-up forward: the draft tokens it confirms cost no forward of their own (code "
                          "being copied or edited)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def resolve_draft_path(target, draft: str) -> Path | None:
    """The draft model file for `draft` ("auto" or a model argument); None when auto
    finds nothing usable for this target."""
    from ..models.bundled import resolve_model
    if draft != "auto":
        return resolve_model(draft)
    fam = target.family
    drafts = fam.drafts_for(target.file) if hasattr(fam, "drafts_for") else fam.drafts
    for d in drafts:
        if d.kind != "model":
            continue
        try:
            path = d.resolve()
        except Exception as e:  # a declared draft that is not installed: try the next, then lookup
            print(f"luce: {str(e).splitlines()[0][:200]}", file=sys.stderr)
            continue
        if path is None or not path.is_file() or path.resolve() == Path(target.path).resolve():
            continue
        if _same_vocab(target, path):
            return path
    return None


def _same_vocab(target, path: Path) -> bool:
    from ..gguf_file import GGUFFile
    f = GGUFFile(path)
    toks = f.get("tokenizer.ggml.tokens")
    mine = target.file.get("tokenizer.ggml.tokens")
    return toks is not None and mine is not None and len(toks) == len(mine) and toks[:1000] == mine[:1000]


def make_drafter(target, opts: SpecOptions, backend=None, n_ctx: int | None = None):
    """The drafter `opts` asks for, for the loaded target model."""
    from .drafters import DraftModel, PromptLookup
    if opts.mode == "lookup" or not opts.draft:
        return PromptLookup()
    path = resolve_draft_path(target, opts.draft)
    if path is None:
        print("luce: no draft model for this target; drafting with prompt lookup", file=sys.stderr)
        return PromptLookup()
    if not _same_vocab(target, path):
        raise LuceError(f"draft {path} does not share the target's tokenizer")
    from ..model import load
    draft = load(path, backend=backend or target.backend, n_ctx=n_ctx or target.n_ctx)
    return DraftModel(draft, n_ctx=n_ctx or target.n_ctx, top_k=opts.top_k, p_min=opts.draft_p_min,
                      lookup=PromptLookup() if opts.draft_lookup else None)
