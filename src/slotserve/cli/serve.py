"""``slotserve serve``: load the model, plan and start the engine, serve it over HTTP.

The engine is built before the port opens, so a plan that does not fit is reported at
once (exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotserve.artifact.named import NAMED_MODELS
from slotserve.cli.executors import add_executor_args, open_model
from slotserve.cli.flags import (
    add_engine_args,
    add_prefix_store_args,
    add_pressure_arg,
    engine_config,
    model_namespace,
    model_specs,
    pressure_source,
    with_prefix_store,
)
from slotserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from slotserve.engine.device import DeviceScheduler
    from slotserve.engine.models import Loaded, ModelSet, ModelSpec
    from slotserve.engine.pressure import PressureSource
    from slotserve.memory import MemoryLedger
    from slotserve.sampling.grammar_index import GrammarCost
    from slotserve.server.chat.defaults import SamplingDefaults

# The share of the KV pool the server's prefix cache may pin by default (cell layout).
SERVER_PREFIX_SHARE = 0.25
# The server's defaults (`HTTPLimits`), repeated so that `--help` does not import the HTTP
# stack (tests/server/test_connection_limits.py checks that they agree).
DEFAULT_HEADER_TIMEOUT_S = 5.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 64
# The grammar bounds' defaults (`GrammarConfig`), repeated for the same reason
# (tests/server/test_grammar_bounds.py checks that they agree).
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0
DEFAULT_GRAMMAR_MAX_BYTES = "32MiB"
DEFAULT_GRAMMAR_CACHE_BYTES = "128MiB"
DEFAULT_GRAMMAR_WORKERS = 1
DEFAULT_GRAMMAR_QUEUE_TIMEOUT_S = 30.0

BUNDLED_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("slotserve")
# Without --queue-depth the server queues this many requests per slot (each with the
# --queue-timeout deadline) instead of refusing at once, as the peers do. Queued requests
# hold no KV, so the memory plan is unchanged.
QUEUE_PER_SLOT = 4


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="OpenAI-compatible HTTP server. Requests that find every slot busy wait "
        f"in a queue of {QUEUE_PER_SLOT} x --max-seqs (deadline --queue-timeout); "
        "--queue-depth 0 refuses them at once (429).",
    )
    add_engine_args(parser, model_set=True)
    add_executor_args(parser)
    add_pressure_arg(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; any other warns unless --api-key is given)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to render chat requests with, instead of the model's own "
        "(a model without one answers chat requests with 400)",
    )
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a whole request head "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g}); slower ones are closed",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive after its head "
        f"(default {DEFAULT_BODY_TIMEOUT_S:g}); slower ones get 408 and are closed",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"connections open at once (default {DEFAULT_MAX_CONNECTIONS}); "
        "the next gets 503 with Retry-After",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        help="connections open at once from one remote client address (loopback clients "
        "share only --max-connections) "
        f"(default {DEFAULT_MAX_CONNECTIONS_PER_CLIENT}); the next gets 503 with Retry-After",
    )
    parser.add_argument("--log-level", default="warning")
    add_server_args(parser)
    add_grammar_args(parser)
    parser.add_argument("--no-web", action="store_true", help="no web page at / (chat, dashboard)")
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="no prefix reuse (default with --kv-layout cell: on, a quarter of the KV pool)",
    )
    add_prefix_store_args(parser)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Sampling defaults, /metrics protection and CORS."""
    sampling = parser.add_argument_group(
        "sampling defaults",
        "for fields a request leaves out; without these flags, the model's "
        "generation_config.json, else temperature 0.8, top_p 0.95, top_k 40, min_p 0.05",
    )
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--repeat-penalty", type=float, default=None)
    parser.add_argument(
        "--reasoning-format",
        choices=("auto", "none"),
        default="auto",
        help="a thinking model's <think>...</think> section: apart from the content "
        "(auto: reasoning_content, a reasoning item, a thinking block) or left inline "
        "(none); a request's reasoning_format field overrides it",
    )
    parser.add_argument(
        "--metrics-key",
        default=None,
        help="require this key (Authorization: Bearer or X-Api-Key) for /metrics, "
        "which is otherwise open to local monitoring",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let a browser page from ORIGIN (e.g. http://localhost:5173) call the API; "
        "repeat for more; off by default",
    )


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """The bounds on compiling response_format schemas (read by `grammar_config`)."""
    group = parser.add_argument_group(
        "structured outputs",
        "each JSON schema a client sends compiles in a worker process at the lowest CPU "
        "priority, killed past these bounds (the request gets 400 naming the bound)",
    )
    group.add_argument(
        "--grammar-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds one schema may take to compile (default {DEFAULT_GRAMMAR_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--grammar-max-bytes",
        default=DEFAULT_GRAMMAR_MAX_BYTES,
        metavar="BYTES",
        help="memory one grammar may take, compiling and kept (default "
        f"{DEFAULT_GRAMMAR_MAX_BYTES})",
    )
    group.add_argument(
        "--grammar-cache-bytes",
        default=DEFAULT_GRAMMAR_CACHE_BYTES,
        metavar="BYTES",
        help="the grammars arena of the memory plan: every compiled grammar alive, cached or "
        f"in use (default {DEFAULT_GRAMMAR_CACHE_BYTES})",
    )
    group.add_argument(
        "--grammar-workers",
        type=int,
        default=DEFAULT_GRAMMAR_WORKERS,
        help=f"schemas compiled at once (default {DEFAULT_GRAMMAR_WORKERS})",
    )
    group.add_argument(
        "--grammar-queue-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_QUEUE_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a schema may wait for a worker (default "
        f"{DEFAULT_GRAMMAR_QUEUE_TIMEOUT_S:g}); then 429 with Retry-After",
    )


def grammar_config(args: argparse.Namespace) -> Any:
    """The `GrammarConfig` of the --grammar-* flags (ValueError naming a bad one)."""
    from slotserve.memory import parse_bytes
    from slotserve.sampling.grammar import GrammarConfig

    return GrammarConfig(
        timeout_s=args.grammar_timeout,
        max_bytes=parse_bytes(args.grammar_max_bytes),
        cache_bytes=parse_bytes(args.grammar_cache_bytes),
        workers=args.grammar_workers,
        queue_timeout_s=args.grammar_queue_timeout,
    )


def import_server() -> None:
    """Import the server's code, as ``serve`` does before its model loads: the ``runtime``
    arena that the load measures (the process before a model) then holds it. ``plan`` calls
    this first, so that it plans the process ``serve`` will be."""
    import slotserve.server  # noqa: F401


# What a server's start leaves after its engine is sized, set aside before sizing so that a
# preset sized to the budget still fits once it is measured: the largest step's one-time
# state (`Engine.measure_cancel_bound`) and the HTTP stack's start (`CancellingServer`).
# Both are measured into it; where they outgrow it the plan is checked again and refuses.
START_RESERVE = 2 << 20


def add_server_arenas(
    ledger: MemoryLedger,
    budget_scope: str,
    cache_bytes: int,
    cost: GrammarCost | None = None,
    *,
    chats: bool = True,
) -> None:
    """Add the server's arenas to ``ledger``: the grammars (``cache_bytes``:
    --grammar-cache-bytes, computed); and where the budget is the whole process's
    (``budget_scope`` ``"process"``: they are the process's, not the model's own) what
    compiling costs (``cost``, as `prepare_grammars` measured it: `add_grammar_cost`), the
    Responses API's stored responses (their byte budget, computed; none where the server
    cannot chat, ``chats`` False: a model with no chat template answers every Responses
    request 400, so it stores none) and the start's reserve (`START_RESERVE`)."""
    from slotserve.server.responses.store import DEFAULT_STORED_BYTES

    if budget_scope == "process":
        if cost is not None:
            add_grammar_cost(ledger, cost)
        if chats:
            ledger.add("responses", DEFAULT_STORED_BYTES, "computed", "stored responses")
        ledger.add("start", START_RESERVE, "reserved", "the server's start, once sized")
    if cache_bytes:
        ledger.add("grammars", cache_bytes, "computed", "--grammar-cache-bytes")


def add_grammar_cost(ledger: MemoryLedger, cost: GrammarCost) -> None:
    """The grammar compiler's index in the server (``grammar_index``) and its compile
    worker processes (``grammar_workers``), both measured at start."""
    if cost.index_bytes:
        ledger.add("grammar_index", cost.index_bytes, "measured", "the grammar compiler's index")
    if cost.workers_bytes:
        source = f"{cost.workers} grammar worker process(es), --grammar-workers"
        ledger.add("grammar_workers", cost.workers_bytes, "measured", source)


def prepare_grammars(model: Any, config: Any) -> tuple[Any, GrammarCost]:
    """The `GrammarCompiler` a server of ``model`` compiles with (``config``: the
    --grammar-* flags), its tokenizer index built and its first compile taken now, and
    what that costs (`GrammarCost`: the ledger's ``grammar_index`` and ``grammar_workers``
    arenas). Called before the engine allocates, so the growth is the index's alone."""
    from slotserve.sampling.grammar import GrammarCompiler
    from slotserve.sampling.grammar_index import prepare

    compiler = GrammarCompiler(model.tokenizer, model.info.vocab_size, config)
    return compiler, prepare(compiler)


def warn_if_template_fails(tokenizer: Any, source: object) -> bool:
    """Warn, loudly, when the chat template (of ``source``: the model, or the
    --chat-template file) cannot render a one-message conversation: every chat request
    would then get 500 template_error. The server still starts (text completions work);
    returns whether it warned."""
    from slotserve.tokenizer import ChatTemplateMissing

    try:
        tokenizer.render_chat([{"role": "user", "content": "Hello"}])
    except ChatTemplateMissing:
        return False  # said per request: 400 chat_template_missing
    except Exception as exc:
        log.warning(
            "WARNING: the chat template of %s cannot render a one-message conversation "
            "(%s: %s): chat requests will get 500 template_error. Fix it, or pass "
            "--chat-template FILE.",
            source, type(exc).__name__, exc,
        )  # fmt: skip
        return True
    return False


def sampling_defaults(args: argparse.Namespace) -> SamplingDefaults:
    """The model's (or the local-server) defaults, with the sampling flags over them."""
    from slotserve.server.chat.defaults import defaults_for

    return defaults_for(args.model).overridden(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
    )


def with_server_queue(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """``config`` with the server's default queue when neither --queue-depth nor a preset
    chose one."""
    chosen = args.queue_depth is not None or getattr(args, "preset", None) is not None
    if chosen:
        return config
    return dataclasses.replace(config, queue_depth=QUEUE_PER_SLOT * config.max_seqs)


def with_server_speculation(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """The server drafts by default, n-grams (`slotserve.engine.speculate`; ``--speculate
    off``: it does not; ``--draft-model``: that model drafts): the engine verifies every
    draft exactly, or refuses to draft where the model could not keep the output unchanged,
    and logs why."""
    if getattr(args, "speculate", None) is None and config.draft_model is None:
        return dataclasses.replace(config, speculate="ngram")
    return config


def with_server_prefix_cache(
    config: EngineConfig, args: argparse.Namespace, model: Any
) -> EngineConfig:
    """The server's prefix cache: on by default for the cell layout, allowed
    ``SERVER_PREFIX_SHARE`` of the KV pool (the plan states it), and for the flat layout,
    whose finished slots park (`with_parked_slots`), where the model keeps the
    exactness guarantee (a restored prefix gives bit for bit the recomputed logits);
    ``--no-prefix-cache`` or ``--prefix-cache 0`` turn it off, ``--prefix-cache BYTES`` and a
    preset choose it."""
    from slotserve.engine.prefix_share import is_exact, with_prefix_cache_share

    if args.no_prefix_cache:
        return dataclasses.replace(config, prefix_cache_bytes=0)
    chosen = args.prefix_cache is not None or getattr(args, "preset", None) is not None
    if chosen or config.kv_layout not in ("cell", "flat"):
        return config
    if not is_exact(model, config):
        log.info(
            "prefix cache off: %s runs %s halves with attention kernel %s, where a restored "
            "prefix is not bit-exact (pass --prefix-cache BYTES to turn it on anyway)",
            model.source, model.halves.kind,
            "on" if model.kernels.attention is not None and config.kernels == "auto" else "off",
        )  # fmt: skip
        return config
    cached = with_prefix_cache_share(config, model, SERVER_PREFIX_SHARE)
    if cached.prefix_cache_bytes and config.kv_layout == "flat":
        log.info("prefix cache on: finished slots park their KV (--no-prefix-cache: off)")
    elif cached.prefix_cache_bytes:
        log.info(
            "prefix cache on: %.1f MiB, %d%% of the KV pool (--no-prefix-cache: off)",
            cached.prefix_cache_budget / 2**20, round(SERVER_PREFIX_SHARE * 100),
        )  # fmt: skip
    return cached


def served_name(spec: str) -> str:
    """The model id clients must send: the bundled model's name, a named model's spec, or
    the file/dir name."""
    if spec == "bundled":
        return BUNDLED_NAME
    if spec in NAMED_MODELS:
        return spec
    path = Path(spec)
    return path.stem if path.suffix == ".gguf" else path.name


def chat_template_text(path: Path | None) -> str | None:
    """The text of ``--chat-template FILE`` (None without the flag)."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty; give a Jinja chat template")
    return text


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack to the server's stderr: what a server
    that stopped answering waits on, without stopping it. Not where stderr has no file
    descriptor (a caller that captures it) or the platform has no SIGUSR1."""
    # AttributeError: no SIGUSR1; ValueError (io.UnsupportedOperation): stderr has no fileno.
    with contextlib.suppress(AttributeError, ValueError):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def run(args: argparse.Namespace) -> int:
    _stacks_on_sigusr1()
    specs = model_specs(args, served_name)
    if specs is None:  # one model: today's server, flag for flag
        return _serve(args)
    return _serve_models(args, specs)


def _serve(args: argparse.Namespace) -> int:
    from slotserve.engine import Engine
    from slotserve.engine.probe import command_ledger
    from slotserve.server import serve
    from slotserve.server.http.connections import HTTPLimits

    limits = HTTPLimits(  # checked before the model loads
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
    )
    template = chat_template_text(args.chat_template)  # read before the model loads
    if args.prefix_store is not None:  # checked before the model loads, and at its open
        from slotserve.prefix.store import check_directory

        check_directory(args.prefix_store)
    grammars = grammar_config(args)  # checked before the model loads
    spec, model, executor = open_model(args)
    if template is not None:
        model.tokenizer.set_chat_template(template, source=f"--chat-template {args.chat_template}")
    warn_if_template_fails(model.tokenizer, args.chat_template or spec)
    compiler, grammar_cost = prepare_grammars(model, grammars)  # measured before the engine
    # The one ledger of the process: the load's arenas, the grammars', and the engine's.
    ledger = command_ledger(model, args.budget_scope)
    chats = model.tokenizer.chat_template is not None
    add_server_arenas(ledger, args.budget_scope, grammars.cache_bytes, grammar_cost, chats=chats)
    try:
        config = engine_config(args, model, ledger)  # with --preset: sized to the ledger
        config = with_server_queue(config, args)
        config = with_server_prefix_cache(config, args, model)
        config = with_server_speculation(config, args)
        config = with_prefix_store(config, args)
        engine = Engine(
            model, config, pressure=pressure_source(args), executor=executor, ledger=ledger
        )
    except BaseException:
        compiler.close()
        raise
    try:
        # /slots and /metrics state the cancellation bound in seconds from the start
        log.info("%s", engine.measure_cancel_bound().describe())
    except BaseException:
        engine.close()
        compiler.close()
        raise
    from slotserve.server.chat import structured

    structured.configure(grammars)
    return serve(
        engine,
        args.served_model_name or served_name(spec),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        limits=limits,
        sampling=sampling_defaults(args),
        metrics_key=args.metrics_key,
        cors_origins=args.cors_origin,
        web=not args.no_web,
        reasoning_format=args.reasoning_format,
        grammar_compiler=compiler,
    )


def _serve_models(args: argparse.Namespace, specs: list[ModelSpec]) -> int:
    """Serve a set of models in one process (docs/MODELS.md): one device ledger (the
    runtime before any model, the server's arenas) beside each model's own, one budget
    (--memory-budget) held by the `ModelSet`, one `DeviceScheduler` for their steps."""
    from slotserve.server import serve
    from slotserve.server.http.connections import HTTPLimits

    if not any(spec.resident for spec in specs):
        raise ValueError(
            "a model set needs at least one resident model (it answers /health and feeds "
            "/metrics); set resident = true on one"
        )
    # The server's own routes (/health, /tokenize, the dashboard's engine view) run on a
    # generating engine: an embedding model cannot be the one that answers them.
    generating = [spec for spec in specs if spec.resident and not is_encoder(spec.source)]
    if not generating:
        raise ValueError(
            "a model set needs a resident chat (generating) model: it answers /health, "
            "/tokenize and the dashboard; an embedding model is served beside one, not alone"
        )
    if args.memory_map is not None or args.budget_scope != "process":
        raise ValueError(
            "several models share one --memory-budget of the whole process; --memory-map "
            "and --budget-scope model apply to one model"
        )
    limits = HTTPLimits(
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
    )
    grammars = grammar_config(args)
    # What the process holds before its models lives as long as it: frozen out of the
    # collector, a model's unload (`ModelSet`, which collects to give its memory back) walks
    # only what the models and their requests made, not every object of torch and the server
    # (collected first, so that no garbage of the start is kept for good).
    gc.collect()
    gc.freeze()
    models = model_set(args, specs, grammars)
    models.start()  # PlanError: the residents (and the largest on-demand model) do not fit
    primary_spec = generating[0]
    primary = primary_spec.name
    engine = models.engine(primary)
    assert engine is not None
    from slotserve.server.chat import structured

    structured.configure(grammars)
    return serve(
        engine,
        primary,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        limits=limits,
        sampling=sampling_defaults(model_namespace(args, primary_spec)),
        metrics_key=args.metrics_key,
        cors_origins=args.cors_origin,
        web=not args.no_web,
        reasoning_format=args.reasoning_format,
        grammar_compiler=None,
        models=models,
    )


def model_set(args: argparse.Namespace, specs: list[ModelSpec], grammars: Any) -> ModelSet:
    """The `ModelSet` of ``specs`` as ``serve`` runs it (and ``plan`` plans it): the
    device ledger (the process's runtime before any model, the server's grammars and
    stored responses), one `DeviceScheduler` and one --pressure signal for every model's
    engine (the device is hot for all of them), each model loaded by `load_member`, against
    --memory-budget. Not started (`ModelSet.start` loads and plans every model)."""
    from slotserve.engine.device import DeviceScheduler
    from slotserve.engine.models import ModelSet
    from slotserve.memory import MemoryLedger, parse_bytes, read_process

    template = chat_template_text(getattr(args, "chat_template", None))  # plan has none
    ledger = MemoryLedger()  # the device's: what no one model owns
    ledger.add("runtime", read_process().anonymous, "measured", "the process before a model")
    add_server_arenas(ledger, "process", grammars.cache_bytes)
    device = DeviceScheduler()
    pressure = pressure_source(args) if hasattr(args, "pressure") else None  # plan: none
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    return ModelSet(
        specs,
        lambda spec: load_member(args, spec, grammars, template, device, pressure),
        budget=budget,
        ledger=ledger,
    )


def load_member(
    args: argparse.Namespace,
    spec: ModelSpec,
    grammars: Any,
    template: str | None,
    device: DeviceScheduler,
    pressure: PressureSource | None = None,
) -> Loaded:
    """Load one model of a set as `_serve` loads the one model (its tokenizer, weights,
    grammar index and first step in a ledger of its own, then its engine), its steps
    taking turns on ``device`` and its background work pausing under ``pressure``;
    nothing stays when any part fails."""
    from slotserve.artifact import load
    from slotserve.engine import Engine
    from slotserve.engine.device import DeviceSeat
    from slotserve.engine.models import Loaded
    from slotserve.executor import executor_for
    from slotserve.memory import MemoryLedger, read_process
    from slotserve.native import KernelChoice

    if is_encoder(spec.source):
        return load_encoder_member(args, spec, device)
    member = model_namespace(args, spec)
    ledger = MemoryLedger()
    # The process's runtime is the device ledger's; this model's runtime is what its own
    # first step and largest step leave (`ledger_for`).
    ledger.add("runtime", 0, "computed", "the process's runtime: the device ledger's")
    before = read_process().anonymous
    kernels: KernelChoice = "off" if member.kernels == "off" else "auto"
    weights = spec.settings.get("weights", args.weights)
    model = load(spec.source, weights=weights, kernels=kernels, ledger=ledger)
    if template is not None:
        model.tokenizer.set_chat_template(template, source=f"--chat-template {args.chat_template}")
    warn_if_template_fails(model.tokenizer, spec.source)
    compiler, grammar_cost = prepare_grammars(model, grammars)
    try:
        add_grammar_cost(ledger, grammar_cost)
        config = engine_config(member, model, ledger)
        config = with_server_queue(config, member)
        config = with_server_prefix_cache(config, member, model)
        config = with_server_speculation(config, member)
        config = dataclasses.replace(config, memory_budget=None, memory_map=None)
        # Its steps take turns on the device with the other models' (`DeviceScheduler`).
        seat = DeviceSeat(device, spec.name)
        engine = Engine(
            model,
            config,
            pressure=pressure,
            executor=executor_for(model),
            ledger=ledger,
            device=seat,
        )
    except BaseException:
        compiler.close()
        raise
    plan = engine.plan
    load_growth = max(ledger.peak_bytes - before, 0)  # the load's transient copies

    def busy() -> bool:
        stats = engine.stats()
        return stats.slots_in_use - stats.slots_parked > 0 or stats.queue_len > 0

    def close() -> None:
        engine.close()
        compiler.close()

    arenas = {name: nbytes for name, nbytes in plan.arenas.items() if nbytes}
    return Loaded(
        engine=engine,
        kind="generate",  # a decoder; an encoder model's loader says "embed"
        plan_bytes=max(plan.worst_case_bytes, load_growth),
        arenas=arenas,
        busy=busy,
        close=close,
        grammar_compiler=compiler,
        # (plan, which serves nothing, has no sampling flags)
        sampling_defaults=sampling_defaults(member) if hasattr(member, "temperature") else None,
    )


def is_encoder(source: str) -> bool:
    """Whether ``source`` names an encoder (embedding) model: ``minilm`` or a
    sentence-transformers directory (its ``modules.json``)."""
    from slotserve.artifact.minilm import MINILM_ALIASES

    return source in MINILM_ALIASES or (Path(source) / "modules.json").is_file()


def load_encoder_member(
    args: argparse.Namespace, spec: ModelSpec, device: DeviceScheduler
) -> Loaded:
    """Load an encoder model of a set (kind ``embed``): its weights and tokenizer in a
    ledger of its own, its `EncoderEngine` planned there (largest step and admitted texts),
    stepped by a `TurnTaker` on ``device``."""
    from slotserve.artifact.encoder import load_encoder
    from slotserve.engine.device import DeviceSeat, TurnTaker
    from slotserve.engine.encoder import EncoderEngine
    from slotserve.engine.encoder_plan import EncoderConfig
    from slotserve.engine.models import Loaded
    from slotserve.memory import MemoryLedger, read_process

    settings = spec.settings
    weights = settings.get("weights", "fp32" if args.weights == "auto" else args.weights)
    ledger = MemoryLedger()
    ledger.add("runtime", 0, "computed", "the process's runtime: the device ledger's")
    before = read_process().anonymous
    model = load_encoder(spec.source, weights=weights, ledger=ledger)
    defaults = EncoderConfig()
    config = EncoderConfig(
        max_texts=int(settings.get("max_texts", defaults.max_texts)),
        max_batch_texts=int(settings.get("max_batch_texts", defaults.max_batch_texts)),
        queue_depth=int(settings.get("queue_depth", defaults.queue_depth)),
    )
    engine = EncoderEngine(model, config, ledger=ledger, start=False)
    turns = TurnTaker(engine, DeviceSeat(device, spec.name))

    def busy() -> bool:
        stats = engine.stats()
        return stats.running > 0 or stats.queue_len > 0

    def close() -> None:
        engine.close()
        turns.stop()

    return Loaded(
        engine=engine,
        kind="embed",
        plan_bytes=max(ledger.total, ledger.peak_bytes - before),  # or the load's growth
        arenas={name: nbytes for name, nbytes in ledger.arenas().items() if nbytes},
        busy=busy,
        close=close,
    )
