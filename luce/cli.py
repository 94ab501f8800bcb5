"""The `luce` command line."""
from __future__ import annotations

import sys

import click

from .bench.synthetic import SHAPES
from .errors import LuceError

MODEL_HELP = "GGUF path, Hugging Face owner/repo:file.gguf, or nothing for the bundled SmolLM2-135M"


class LuceGroup(click.Group):
    """Turns LuceError (bad model file, bad argument) into one line on stderr and exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LuceError as e:
            click.echo(f"luce: error: {e}", err=True)
            sys.exit(1)

    # plugins' commands (the register_commands hook), added when commands are first looked up
    def list_commands(self, ctx):
        from .plugins import register_commands
        register_commands(self)
        return super().list_commands(ctx)

    def get_command(self, ctx, name):
        from .plugins import register_commands
        register_commands(self)
        return super().get_command(ctx, name)


@click.group(cls=LuceGroup)
@click.version_option(package_name="luce")
def main():
    """luce: local LLM inference for GGUF models."""


def sampling_options(f):
    opts = [
        click.option("--max-tokens", "-n", type=int, default=256, show_default=True),
        click.option("--temperature", "--temp", type=float, default=None, help="0 for greedy"),
        click.option("--top-k", type=int, default=None),
        click.option("--top-p", type=float, default=None),
        click.option("--min-p", type=float, default=None),
        click.option("--repeat-penalty", type=float, default=None),
        click.option("--presence-penalty", type=float, default=None),
        click.option("--frequency-penalty", type=float, default=None),
        click.option("--seed", type=int, default=None),
        click.option("--stop", multiple=True, help="stop string (repeatable)"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _spec_options(f):
    from .spec.options import spec_options
    return spec_options(f)


def backend_option(f):
    return click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)(f)


@main.command()
@click.argument("args", nargs=-1, required=True)
@click.option("--chat", is_flag=True, help="apply the model's chat template to PROMPT")
@click.option("--system", default=None, help="system message (with --chat)")
@click.option("--ctx", "n_ctx", type=int, default=None, help="context size")
@backend_option
@sampling_options
@_spec_options
def generate(args, chat, system, n_ctx, backend, max_tokens, stop, spec, draft, ddtree_budget, draft_max,
             draft_p_min, draft_ahead, draft_lookup, **sampling):
    """Generate text: luce generate [MODEL] PROMPT"""
    from .model import load
    from .spec import SpecOptions, make_drafter
    from .spec import stream as spec_stream

    if len(args) > 2:
        raise click.UsageError("expected [MODEL] PROMPT (quote the prompt)")
    model_arg, prompt = (None, args[0]) if len(args) == 1 else args
    model = load(model_arg, backend=backend, n_ctx=n_ctx, progress=sys.stderr.isatty())
    params = {k: v for k, v in sampling.items() if v is not None}
    spec_opts = SpecOptions.from_cli(spec, draft, ddtree_budget, draft_max, draft_p_min, draft_ahead, draft_lookup)
    drafter = make_drafter(model, spec_opts) if spec_opts.enabled else None
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = model.chat_prompt_ids(messages)
    else:
        prompt_ids = model.tokenize(prompt)
        click.echo(prompt, nl=False)
    stats = None
    for d in spec_stream(model, prompt_ids, spec_opts, drafter, max_tokens=max_tokens, stop=tuple(stop), **params):
        if d.text:
            click.echo(d.text, nl=False)
            sys.stdout.flush()
        stats = d.stats or stats
    click.echo()
    if stats:
        click.echo(f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tok_s:.1f} tok/s | "
                   f"generated: {stats.completion_tokens} tokens, {stats.decode_tok_s:.1f} tok/s "
                   f"[{model.backend.name}]", err=True)
        if spec_opts.enabled:
            click.echo(f"speculative ({spec_opts.mode}, {type(drafter).__name__}): {stats.target_forwards} target "
                       f"forwards, acceptance length {stats.acceptance_length:.2f}, draft {stats.draft_s:.2f}s, "
                       f"verify {stats.verify_s:.2f}s", err=True)


@main.command()
@click.argument("model", required=False)
def info(model):
    """Describe a model: architecture, family, sizes, tensor types, chat template."""
    from collections import Counter

    from .gguf_file import GGUFFile
    from .models.bundled import resolve_model
    from .plugins import family_for

    from .kernels.dequant import SUPPORTED_TYPES

    path = resolve_model(model)
    f = GGUFFile(path)
    f.require_types(SUPPORTED_TYPES)
    fam = family_for(path, f.architecture)
    cfg = fam.read_config(f)
    types = Counter(t.type_name for t in f.tensors.values())
    click.echo(f"file:          {path}")
    click.echo(f"name:          {f.get('general.name', '?')}")
    click.echo(f"architecture:  {f.architecture} (family {fam.name!r} from {fam.plugin})")
    click.echo(f"parameters:    {f.n_params / 1e6:.1f} M, file {f.n_bytes / 2**20:.1f} MiB")
    click.echo(f"layers:        {cfg.n_layers}, embd {cfg.n_embd}, ffn {cfg.n_ff}")
    click.echo(f"heads:         {cfg.n_heads} q / {cfg.n_kv_heads} kv, head dim {cfg.head_dim}")
    click.echo(f"vocab:         {cfg.vocab_size}, context {cfg.n_ctx_train}, rope base {cfg.rope_base:g} ({cfg.rope_style})")
    click.echo(f"output head:   {'tied to token_embd' if cfg.tied_output else 'separate'}")
    click.echo("tensor types:  " + ", ".join(f"{k} x{v}" for k, v in types.most_common()))
    click.echo(f"chat template: {'yes' if f.get('tokenizer.chat_template') else 'no'}")
    drafts = fam.drafts_for(f)
    if drafts:
        click.echo("drafts:        " + ", ".join(str(d) for d in drafts))
    if fam.optimizations:
        click.echo("optimizations: " + ", ".join(f"{k}={v}" for k, v in fam.optimizations.items()))
    if fam.sampling_defaults:
        click.echo("sampling:      " + ", ".join(f"{k}={v}" for k, v in fam.sampling_defaults.items()))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def families(as_json):
    """List model families: architectures, drafts, optimizations, and the plugin each came from."""
    from .plugins import families_report
    click.echo(families_report(as_json=as_json))


@main.command()
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (loopback by default)")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-ctx", "n_ctx", type=int, default=None, help="context size in tokens")
@click.option("--api-key", envvar="LUCE_API_KEY", default=None,
              help="require this key (Authorization: Bearer KEY or x-api-key: KEY); env LUCE_API_KEY")
@click.option("--model-name", default=None, help="the model id clients use [default: the file name]")
@click.option("--accept-any-model", is_flag=True,
              help="answer any model name with this model (for clients with fixed model names)")
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Jinja chat template to use instead of the model's own")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="requests that may wait for the engine; more are answered 429")
@click.option("--timeout", "request_timeout", type=float, default=600.0, show_default=True,
              help="seconds a request may take, queue wait included (0: no limit)")
@click.option("--kv-slots", type=int, default=1, show_default=True,
              help="KV caches kept warm for different conversations (each costs a full context of memory)")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@backend_option
@_spec_options
def serve(model, host, port, n_ctx, api_key, model_name, accept_any_model, chat_template_file, max_queue,
          request_timeout, kv_slots, log_level, backend, spec, draft, ddtree_budget, draft_max, draft_p_min,
          draft_ahead, draft_lookup):
    """Serve MODEL over the OpenAI, Anthropic and Responses APIs."""
    import logging

    import uvicorn

    from .model import load
    from .server.app import create_app
    from .spec import SpecOptions, make_drafter
    from .spec import stepper_factory as spec_stepper_factory

    if max_queue < 0:
        raise click.BadParameter("must be >= 0", param_hint="--max-queue")
    if kv_slots < 1:
        raise click.BadParameter("must be >= 1", param_hint="--kv-slots")
    template = None
    if chat_template_file:
        with open(chat_template_file, encoding="utf-8") as fh:
            template = fh.read()
    opts = SpecOptions.from_cli(spec, draft, ddtree_budget, draft_max, draft_p_min, draft_ahead, draft_lookup)
    # the model loads before the port opens: a client never meets a half-started server
    m = load(model, backend=backend, n_ctx=n_ctx, progress=sys.stderr.isatty(), chat_template=template)
    stepper_factory, draft_label = None, None
    if opts.enabled:
        drafter = make_drafter(m, opts)
        stepper_factory = spec_stepper_factory(m, opts, drafter)
        draft_label = {"mode": opts.mode, "draft": opts.draft, "drafter": type(drafter).__name__,
                       "ddtree_budget": opts.ddtree_budget, "draft_max": opts.draft_max_label,
                       "draft_p_min": opts.draft_p_min, "draft_ahead": opts.draft_ahead,
                       "draft_lookup": opts.draft_lookup}
    app = create_app(m, model_name=model_name, api_key=api_key, max_queue=max_queue,
                     request_timeout=request_timeout or None, draft=draft_label, stepper_factory=stepper_factory,
                     accept_any_model=accept_any_model, kv_slots=kv_slots,
                     settings={"host": host, "port": port, "chat_template_file": chat_template_file})
    name = app.state.luce.model_name
    click.echo(f"luce: {name} loaded in {m.load_s:.1f} s [{m.backend.name}, ctx {m.n_ctx}]; serving on "
               f"http://{host}:{port}/v1 (OpenAI, Anthropic /v1/messages, Responses /v1/responses)", err=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo("luce: warning: listening beyond loopback without --api-key", err=True)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)



@main.command()
@click.argument("model", required=False)
@click.option("--synthetic", type=click.Choice(list(SHAPES)), default=None,
              help="random weights with a real model's shapes and Q4_K_M tensor types")
@backend_option
@click.option("--prompt-tokens", type=int, default=512, show_default=True)
@click.option("--gen-tokens", type=int, default=128, show_default=True)
@click.option("--long-ctx", type=int, default=8192, show_default=True, help="0 to skip the long-context decode")
@click.option("--kernels", "kernels", is_flag=True, help="benchmark the kernels at Qwen3-8B/32B shapes instead")
@click.option("--spec", "spec", is_flag=True,
              help="speculative decoding on the fixed prompt set: acceptance and tok/s per mode "
                   "(MODEL and --draft default to the Qwen2.5-Coder 1.5B/0.5B pair)")
@click.option("--draft", default=None, help="draft model for --spec (with --synthetic: synthetic:NAME, by default "
                                            "the family's smallest shape)")
@click.option("--categories", default=None, help="--spec: code,math,chat,edit (default all)")
@click.option("--draft-lookup", "draft_lookups", default="0", show_default=True,
              help="--spec: 1 seeds the draft model's chain by prompt lookup (--draft-lookup of generate and "
                   "serve); 0,1 runs both in turn")
@click.option("--spec-modes", default="off,chain,ddtree", show_default=True,
              help="--spec: the modes run on every prompt (off, chain, ddtree, lookup)")
@click.option("--ddtree-budget", type=int, default=None, help="--spec: DDTree node budget per target forward [22]")
@click.option("--draft-max", default=None,
              help="--spec: longest draft, the tree's depth, or auto [8: where the pair's acceptance is tabled]; "
                   "several (4,6,8,auto) run in turn over one load")
@click.option("--draft-p-min", type=float, default=None,
              help="--spec: stop a draft where its chain's probability falls below this [0: never, so that a "
                   "random-weight draft costs a full draft]")
@click.option("--draft-ahead", default=None, metavar="N[,N...]",
              help="--spec: draft steps queued beside each verification [0]; several (0,7) run in turn")
@click.option("--profile", type=int, default=0, metavar="N",
              help="--spec: the speculative runs under cProfile, its N functions of most own time (host work)")
@click.option("--no-record", is_flag=True, help="do not append the figures to docs/benchmarks.md")
@click.option("--no-breakdown", is_flag=True,
              help="skip the per-op and host-time tables (each op timed alone: most of a GPU run's time)")
@click.option("--compare", "compare", multiple=True, metavar="'VAR=VALUE ...'",
              help="run the bench once as set and once with each setting (LUCE_*/NUMBA_* variables, read "
                   "when kernels compile: a process each), figures side by side; repeatable")
@click.option("--rounds", type=int, default=1, show_default=True, help="--compare: runs of each setting, alternating")
@click.option("--verify-widths", default="1,2,4,8,16,23,32,64", show_default=True,
              help="tree sizes whose verification is timed (each new size compiles its kernels first)")
def bench(model, synthetic, backend, prompt_tokens, gen_tokens, long_ctx, kernels, spec, draft, categories,
          draft_lookups, spec_modes, ddtree_budget, draft_max, draft_p_min, draft_ahead, profile, no_record,
          no_breakdown, compare, rounds, verify_widths):
    """Benchmark a model (or --synthetic NAME) end to end, the kernels (--kernels), or
    speculative decoding (--spec)."""
    if compare:
        from .bench import compare as C
        from .bench.report import print_table
        if kernels or spec:
            raise click.UsageError("--compare runs the end-to-end bench: not with --kernels or --spec")
        if rounds < 1:
            raise click.BadParameter("at least 1", param_hint="--rounds")
        try:
            settings = C.parse_settings(compare)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--compare")
        args = ([model] if model else []) + (["--synthetic", synthetic] if synthetic else []) + [
            "--backend", backend, "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens),
            "--long-ctx", str(long_ctx), "--verify-widths", verify_widths] + (["--no-breakdown"] if no_breakdown else [])
        results = C.run_all(args, settings, rounds)
        for r in results:
            if r["returncode"] != 0:
                click.echo(f"-- {r['setting']} (round {r['round']}) failed:\n{r['tail']}", err=True)
        print_table("luce bench --compare (each round's figure, in run order)", C.table(results))
        return
    if spec:
        from .bench.report import append_to_docs
        from .bench.spec import run as run_spec, summary
        from .spec import SPEC_MODES, SpecOptions
        modes = tuple(m.strip() for m in spec_modes.split(",") if m.strip())
        if not modes or any(m not in SPEC_MODES for m in modes):
            raise click.BadParameter(f"{spec_modes!r}: comma-separated modes of {', '.join(SPEC_MODES)}",
                                     param_hint="--spec-modes")
        from .spec.options import BENCH_DRAFT_MAX, draft_max_label, parse_draft_maxes
        try:
            depths = parse_draft_maxes(BENCH_DRAFT_MAX if draft_max is None else draft_max)
        except LuceError as e:
            raise click.BadParameter(str(e), param_hint="--draft-max")
        from .bench.spec import parse_aheads
        try:
            aheads = parse_aheads(0 if draft_ahead is None else draft_ahead)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--draft-ahead")
        seeds = tuple(dict.fromkeys(v.strip() == "1" for v in draft_lookups.split(",") if v.strip()))
        if not seeds or any(v.strip() not in ("0", "1") for v in draft_lookups.split(",") if v.strip()):
            raise click.BadParameter(f"{draft_lookups!r}: 0, 1 or 0,1", param_hint="--draft-lookup")
        # p-min 0 unless told: the pair's acceptance tables are at 0, and on random weights a
        # cut-off would end every draft at its first token (the cost of a full draft is the point)
        opts = SpecOptions.from_cli("ddtree", None, ddtree_budget, depths[0], draft_p_min or 0.0)  # checks the numbers
        if synthetic:
            # random weights: acceptance near one, but the real shapes' draft and
            # verification costs a step (the summary's ms / forward columns)
            from .bench.synthetic import DRAFTS
            if model:
                raise click.UsageError("--spec takes MODEL or --synthetic, not both")
            name = draft.removeprefix("synthetic:") if draft and draft.startswith("synthetic:") else None
            if draft is None:
                name = DRAFTS.get(synthetic)
                if name is None:
                    raise click.UsageError(f"--synthetic {synthetic}: no draft shape of its vocabulary; give --draft")
            # made in memory (luce.load's synthetic:NAME): no multi-GB GGUF written and read back
            model, draft = f"synthetic:{synthetic}", f"synthetic:{name}" if name else draft
        # a shape's costs: the draft's step alone against what a draft of draft max costs
        costs = {} if synthetic and any(m in ("chain", "ddtree") for m in modes) else None
        results = run_spec(model, draft, modes=modes,
                           categories=tuple(categories.split(",")) if categories else None, max_tokens=gen_tokens,
                           ddtree_budget=opts.ddtree_budget, draft_max=depths,
                           draft_p_min=opts.draft_p_min, backend=backend, costs=costs, profile=profile,
                           draft_ahead=aheads, draft_lookup=seeds)
        tables = [("acceptance length (tokens per target forward) and tok/s", summary(results), None)]
        if any(r.phases for r in results):
            from .bench.spec import phases
            title, table = "where a target forward's time goes (ms a target forward)", phases(results)
            click.echo(f"\n{title}\n{table}")
            tables.append((title, table, None))
        if costs:
            from .bench.spec import costs_table
            title = "the draft's step alone and a whole draft"
            click.echo(f"\n{title}\n{costs_table(costs)}")
            tables.append((title, costs_table(costs), None))
        if synthetic:
            from .bench.spec import PAIR_ACCEPTANCE_LONG_AT, PAIR_SETTINGS, projection
            if PAIR_SETTINGS == {"ddtree_budget": opts.ddtree_budget, "draft_p_min": opts.draft_p_min}:
                pair = "the Qwen2.5-Coder 0.5B -> 1.5B pair's acceptance (measured on the CPU)"
                for title, table in ((f"projected with {pair}, 48 tokens a prompt", projection(results)),
                                     (f"projected with {pair}, 128 tokens a prompt (code, DDTree at 6, 8, 10)",
                                      projection(results, PAIR_ACCEPTANCE_LONG_AT))):
                    if table.count("\n") > 1:  # rows beyond the header
                        click.echo(f"\n{title}\n{table}")
                        tables.append((title, table, None))
                from .bench.spec import cost_line, policy_projection
                line, table = cost_line(results), policy_projection(results)
                if line is not None and table.count("\n") > 1:
                    title = (f"drafting policies projected with {pair} (code over 128 tokens a prompt, math and chat "
                             f"over 64), at this run's cost line "
                             f"({line[0]:.2f} ms + {line[1]:.3f} ms a draft forward, over its DDTree depths)")
                    click.echo(f"\n{title}\n{table}")
                    tables.append((title, table, None))
            else:
                click.echo("no projection: the pair's acceptance was measured at "
                           + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in PAIR_SETTINGS.items()))
        if not no_record:
            append_to_docs("luce bench --spec", tables,
                           notes=f"greedy, {gen_tokens} tokens a prompt, DDTree budget {opts.ddtree_budget}, "
                                 f"draft max {','.join(str(draft_max_label(d)) for d in depths)}, "
                                 f"draft p-min {opts.draft_p_min}")
        return
    if kernels:
        from .bench.kernels import run as run_kernels
        run_kernels(record=not no_record)
        return
    from .bench.e2e import run
    try:
        widths = tuple(sorted({int(w) for w in verify_widths.split(",") if w.strip()} | {1}))
    except ValueError:
        raise click.BadParameter(f"{verify_widths!r}: comma-separated integers", param_hint="--verify-widths")
    if widths[-1] > 64:
        raise click.BadParameter("at most 64 nodes (a tree's mask word)", param_hint="--verify-widths")
    run(model, synthetic, backend, n_prompt=prompt_tokens, n_gen=gen_tokens, long_ctx=long_ctx,
        record=not no_record, per_op=not no_breakdown, verify_widths=widths)

if __name__ == "__main__":
    main()
