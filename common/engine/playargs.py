"""The flags of every stage that plays (rollout.py, evaluate.py), and what they build.

    add_play_args(parser[, evaluation=True])                       # evaluation: bfcl-eval's local inference
    spec = play_spec(args, parser, omega=omega, temperature=1.0)   # a common.engine.episode.PlaySpec
    spec = eval_spec(args, parser, decoding=env.decoding)          # evaluation's
    with open_engine(args, model, max_model_len=spec.max_model_len, seed=0, log=path) as engine: ...
"""

import contextlib

from common.engine import serve
from common.engine.episode import HandlerError, PlaySpec
from common.engine.episode import call_format as handler_format
from common.jsonl import RecordError
from common.presets import ENGINE

BFCL_MAX_NEW_TOKENS = 4096  # bfcl-eval's OSSHandler._query_prompting cap


def add_play_args(parser, *, evaluation=False):
    """The engine and play flags of every stage that plays, at PlaySpec's defaults; an `evaluation` plays as
    bfcl-eval's local inference: the model's context (None here) and 4096 new tokens a call."""
    max_model_len = None if evaluation else PlaySpec.max_model_len
    parser.add_argument("--engine", default=ENGINE, choices=["vllm", "hf"],
                        help="vllm (vLLM servers, common/engine/serve.py), or hf (transformers generate in this process, "
                             "lock-step only)")
    parser.add_argument("--handler", default=PlaySpec.handler,
                        help="the bfcl-eval handler whose prompts the model is shown and whose call format is "
                             "the default (common/engine/episode.py CALL_FORMATS)")
    parser.add_argument("--call-format", default=PlaySpec.fmt, choices=["json", "python"],
                        help="how calls are decoded: json, Qwen <tool_call> blocks; python, [f(a=1)] lists "
                             "(ToolACE); default: the handler's, and one that contradicts it is refused")
    parser.add_argument("--max-steps-per-turn", type=int, default=PlaySpec.max_steps_per_turn,
                        help="a turn's step with calls past this many force-quits the task (default, "
                             "bfcl-eval's: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=max_model_len,
                        help="context in tokens (default: %(default)s)" if max_model_len is not None else
                        "context (default: the model's max_position_embeddings, as bfcl-eval's local inference)")
    parser.add_argument("--max-new-tokens", type=int,
                        default=BFCL_MAX_NEW_TOKENS if evaluation else PlaySpec.max_new_tokens,
                        help="cap on new tokens per model call (default: %(default)s; bfcl-eval: "
                             "min(4096, context - prompt - 2))")
    serve.add_server_args(parser)
    parser.add_argument("--schedule", default=None, choices=["async", "lockstep"],
                        help="per-trajectory (vLLM's default) or one batched call per step (HF's only)")


def play_spec(args, parser, **fixed):
    """The PlaySpec of add_play_args' flags, with the stage's own settings `fixed`."""
    fmt = call_format(args, parser)
    # async by default on vLLM; HF generate runs lock-step only
    if args.engine == "hf" and args.schedule == "async":
        parser.error("--schedule async needs --engine vllm (the HF engine advances trajectories in lock-step)")
    schedule = args.schedule or ("async" if args.engine == "vllm" else "lockstep")
    return PlaySpec(**{"fmt": fmt, "max_steps_per_turn": args.max_steps_per_turn, "max_model_len": args.max_model_len,
                       "max_new_tokens": args.max_new_tokens, "schedule": schedule, "handler": args.handler, **fixed})


def call_format(args, parser):
    try:
        return handler_format(args.handler, args.call_format)
    except HandlerError as e:
        parser.error(f"--handler {args.handler} --call-format {args.call_format or '(unset)'}: {e}")


def eval_spec(args, parser, decoding="greedy"):
    """The PlaySpec of an evaluation of `args.policy` as bfcl-eval's local inference: Ω absent, prompts
    re-rendered every step, within the model's context. `decoding` "bfcl" samples as bfcl-eval asks vLLM
    (temperature 0.001, the rest from generation_config.json, as vLLM applies it); "greedy": the argmax."""
    if args.policy == "oracle":
        return PlaySpec(fmt=call_format(args, parser), handler=args.handler)
    from common.engine.models import model_context, model_sampling

    context = model_context(args.policy)
    if args.max_model_len and args.max_model_len > context:
        parser.error(f"--max-model-len {args.max_model_len} exceeds the model's context ({context})")
    sampling = {"temperature": 0.001, **model_sampling(args.policy)} if decoding == "bfcl" else 0.0
    return play_spec(args, parser, temperature=sampling, max_model_len=args.max_model_len or context, rerender=True)


@contextlib.contextmanager
def open_engine(args, model, *, max_model_len, seed, log, gpu_memory_utilization=None):
    """The stage's engine for `model`: vLLM servers (--server URL[,URL...], or one started here for the
    block's lifetime, logging to --server-log or `log`), checked to serve `model`'s weights before anything
    plays; or transformers generate in this process (--engine hf)."""
    from common.engine.engines import HFEngine, ServerEngine  # imports torch: only for model policies

    if args.engine == "hf":
        if args.server or args.tensor_parallel_size != 1 or args.data_parallel_size != 1:
            raise RecordError("--engine hf runs in this process: no --server, tensor or data parallel size")
        with contextlib.closing(HFEngine(model, max_model_len=max_model_len, seed=seed)) as engine:
            yield engine
        return
    with contextlib.ExitStack() as stack:
        if args.server:
            urls = serve.parse_servers(args.server)
            logs = {urls[0]: args.server_log} if args.server_log and len(urls) == 1 else {}
        else:
            log = args.server_log or log
            url = stack.enter_context(serve.serving(
                model, log, max_model_len=max_model_len, seed=seed, tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size, gpu_memory_utilization=gpu_memory_utilization))
            urls, logs = [url], {url: log}
        engine = ServerEngine(urls, model, max_model_len=max_model_len, seed=seed, logs=logs,
                              data_parallel_size=args.data_parallel_size)
        stack.callback(engine.close)
        yield engine
