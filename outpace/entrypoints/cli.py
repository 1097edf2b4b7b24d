"""`outpace` command line: generate, chat, serve, init-draft, train-draft, eval-draft.

The parser and the dispatch (each subcommand's `func`); what each command does is in
cli_commands.py, what the flags mean for the engine in cli_options.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from outpace import __version__
from outpace.entrypoints.cli_commands import (cmd_chat, cmd_eval_draft, cmd_generate,
                                              cmd_init_draft, cmd_serve, cmd_train_draft)
from outpace.errors import OutpaceError


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (`outpace: error: ...`, naming the
    subcommand's --help), as every other error of the CLI is."""

    def error(self, message):
        self.exit(2, f"outpace: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` ends each option's help with its default, so a user sees every default without
    the docs; except where there is nothing to show (None, an empty list, an off flag): those
    options' help says what leaving them out does."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags; their defaults are EngineArgs' (engine/args.py)."""
    from outpace.engine.args import EngineArgs
    d = EngineArgs()
    # None, so that a command taking MODEL as well can tell whether --model was given
    p.add_argument("--model", default=None,
                   help="catalog name (smollm2-135m), Hugging Face folder, .gguf file, or "
                   "Hugging Face model id (owner/name, fetched into the Hugging Face cache) "
                   f"(default: {d.model})")
    p.add_argument("--download-dir", default=d.download_dir, metavar="DIR",
                   help="the cache Hugging Face model ids are fetched into and looked up in "
                   "(default: Hugging Face's: HF_HUB_CACHE, else ~/.cache/huggingface/hub)")
    p.add_argument("--device", default=d.device,
                   help="cpu or cuda (auto: cuda when available)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"],
                   help="activations, arithmetic and (unless --kv-cache-dtype) the KV cache "
                   "(auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--weight-dtype", default=d.weight_dtype,
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="storage of the weight matrices (auto: --dtype); --dtype float32 "
                   "--weight-dtype bfloat16: bf16 weight memory, fp32 arithmetic")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="the KV cache's dtype (auto: --dtype); with --dtype float32, bfloat16 "
                   "keeps bf16's cache size and attention bytes")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length, prompt + output (default: the model's "
                   "max_position_embeddings, or what the KV cache holds if less)")
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                   help="KV pool size in blocks, counting the reserved block 0 (default: sized "
                   "from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   metavar="SHARE",
                   help="as in vLLM: the share of the GPU's total memory the engine may use, in "
                   "(0, 1]; the KV pool gets what the weights and a step's activations leave "
                   "of it (default: 0.85 of the memory free once the weights load; ignored on "
                   "CPU, whose pool is 1 GiB or --num-kv-blocks)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens a step may hold, prefill chunks and decodes (default: 8192 on a "
                   "GPU of 70 GiB or more, else 2048)")
    p.add_argument("--max-prefill-with-decodes", type=int, default=d.max_prefill_with_decodes,
                   metavar="N",
                   help="prefill tokens a step may carry beside running decodes, so that a long "
                   "prompt does not stall other streams (default: 8 on a CPU, 0 on a GPU); 0: "
                   "the whole budget")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   metavar="N",
                   help="split the model (and its draft head) over N processes (ranks), as "
                   "vLLM does; on the CPU for now")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV cache of prompt prefixes seen before")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each decode step's outputs before launching the next")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="torch's seed and the source of requests' sampling seeds")
    p.add_argument("--spec", default=None, choices=["ngram", "suffix", "mtp", "eagle3"],
                   help="speculative decoding method (default: none)")
    p.add_argument("--draft", default=None, help="draft head folder (mtp, eagle3; default: the "
                   "head shipped for the model, if any)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: 3)")
    p.add_argument("--spec-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra speculative option (repeatable), e.g. "
                        "k_schedule=[[8,4],[32,2]] (every option: docs/configuration.md)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='the whole speculative config as JSON, as vLLM takes it, e.g. '
                        '\'{"method": "eagle3", "num_speculative_tokens": 2}\' (instead of '
                        '--spec and its flags)')
    p.add_argument("--chat-template", default=d.chat_template, metavar="FILE_OR_STRING",
                   help="a Jinja chat template (a file, or the template itself) in place of the "
                   "model's")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """MODEL, the optional positional model of chat, serve and bench latency / throughput (as
    `vllm serve MODEL`); --model (add_engine_args) says the same, and generate takes only
    --model, its positional being the prompt (docs/decisions.md, "The model: MODEL or
    --model")."""
    from outpace.engine.args import EngineArgs
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help=f"the model, as --model takes it (default: {EngineArgs().model})")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0: off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0; divides the logits of tokens seen in the prompt or output (1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted per earlier occurrence in the output (0: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; subtracted once a token occurs in the output (0: off)")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="per-request sampling seed (default: one drawn from --seed)")
    p.add_argument("--spec-stats", action="store_true", help="print speculative decoding stats")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="outpace", description=__doc__.split("\n")[0],
                       formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"outpace {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=ArgumentParser)

    def add_parser(name, **kw):
        return sub.add_parser(name, formatter_class=HelpFormatter,
                              description=kw.get("help"), **kw)

    g = add_parser("generate", help="generate a completion, streamed to the terminal")
    g.add_argument("prompt", help="the prompt (a user turn, unless --raw)")
    g.add_argument("--raw", action="store_true",
                   help="no chat template: the prompt is the text as given")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = add_parser("chat", help="interactive chat")
    add_model_arg(c)
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    s = add_parser("serve", help="OpenAI-compatible server")
    add_model_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=int, default=8000, help="port")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name the API lists and answers to (default: MODEL)")
    s.add_argument("--max-waiting", type=int, default=None,
                   help="bound of the waiting queue; more requests get 503 (default: "
                   "no bound)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="a connection that has not sent a complete request header this long "
                   "after it opened or after its last response is closed")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="run the engine loop in a process of its own, apart from the HTTP "
                   "front end (tokenization, detokenization, streaming); "
                   "--no-engine-process: in a thread of the server's process (default: a process "
                   "on a GPU, a thread on the CPU)")
    s.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="HTTP front-end processes sharing the port over the one engine "
                   "process (more than 1 implies --engine-process; default: 1)")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    d = add_parser("init-draft", help="write a randomly initialised draft head")
    d.add_argument("--method", required=True, choices=["mtp", "eagle3"], help="head kind")
    d.add_argument("--target", default="smollm2-135m",
                   help="the model the head drafts for (catalog name, HF folder or .gguf file)")
    d.add_argument("--out", required=True, help="folder to write (must not hold a head)")
    d.add_argument("--num-layers", type=int, default=1, help="MTP depths (modules)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    d.add_argument("--quiet", action="store_true", help="no progress output")
    d.set_defaults(func=cmd_init_draft)
    t = add_parser("train-draft", help="self-distill and train an EAGLE-3 or MTP head")
    t.add_argument("--method", required=True, choices=["eagle3", "mtp"], help="head kind")
    t.add_argument("--target", default="smollm2-135m",
                   help="catalog name, HF folder or .gguf file")
    t.add_argument("--data", required=True,
                   help='training prompts, JSONL with one {"prompt": ...} per line')
    t.add_argument("--out", required=True, help="folder for the head (and its checkpoints)")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="EAGLE-3 draft vocabulary size (default 8192, or the target's if "
                   "smaller; with --init-head, a larger size grows the head's vocabulary)")
    t.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="I",
                   help="EAGLE-3: the 3 target layers whose outputs the head fuses (default "
                   "1, L/2-1, L-4)")
    t.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time-test steps (default 7 for EAGLE-3, 3 for MTP)")
    t.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this exported head (its weights, and for EAGLE-3 its "
                   "draft vocabulary and aux layers), e.g. one shipped in outpace/heads/")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (on a GPU, faster steps after a "
                   "compile at the start; see docs/performance.md)")
    t.add_argument("--num-modules", type=int, default=1,
                   help="MTP modules (more than one trains depths mode)")
    t.add_argument("--epochs", type=float, default=1.0, help="passes over the data")
    t.add_argument("--lr", type=float, default=5e-4,
                   help="peak learning rate (cosine schedule)")
    t.add_argument("--warmup", type=float, default=0.03, help="share of steps warming up")
    t.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens a batch")
    t.add_argument("--max-len", type=int, default=2048, help="tokens a sequence at most")
    t.add_argument("--answer-tokens", type=int, default=512,
                   help="max tokens of each self-distilled answer")
    t.add_argument("--samples", type=int, default=0,
                   help="sampled answers per prompt beside the greedy one")
    t.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    t.add_argument("--loop-tokens", type=int, default=64,
                   help="answer tokens kept once an answer starts repeating itself verbatim "
                        "(-1: keep them all)")
    t.add_argument("--max-prompts", type=int, default=None,
                   help="use the first N prompts (default: all)")
    t.add_argument("--holdout", type=int, default=0,
                   help="hold the last N prompts out and report their TTT accuracy")
    t.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    t.add_argument("--data-cache", default=None,
                   help="the self-distilled answers' JSONL (default OUT/selfdistill.jsonl)")
    t.add_argument("--extra-answers", nargs="+", default=(), metavar="FILE",
                   help="earlier runs' answer caches (another --seed; .jsonl or .jsonl.gz): "
                        "their sampled answers join the data")
    t.add_argument("--resume", default=None,
                   help="a checkpoint folder, or the OUT folder of an earlier run")
    t.add_argument("--max-minutes", type=float, default=None,
                   help="time budget of the training steps (the schedule fits to it; default: "
                   "none)")
    t.add_argument("--seed", type=int, default=0, help="seed of data order and init")
    t.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when available)")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    t.set_defaults(func=cmd_train_draft)
    e = add_parser("eval-draft", help="a head's acceptance per position, through the engine")
    e.add_argument("--method", required=True, choices=["eagle3", "mtp"], help="head kind")
    e.add_argument("--draft", default=None,
                   help="draft head folder (default: the head shipped for the target)")
    e.add_argument("--target", default="smollm2-135m", help="the model the head drafts for")
    e.add_argument("--prompts", nargs="+", required=True, metavar="[NAME=]FILE",
                   help="prompt sets (JSONL), e.g. mtbench=mtbench.jsonl")
    e.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7],
                   help="draft lengths to measure (one engine each)")
    e.add_argument("--max-tokens", type=int, default=256, help="output tokens per prompt")
    e.add_argument("--max-prompts", type=int, default=None,
                   help="first N prompts of each set (default: all)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="engine batch")
    e.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when available)")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="activations and weights (auto: float32 on CPU, bfloat16 on CUDA)")
    e.add_argument("--spec-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra speculative option of every engine (repeatable), e.g. "
                        "draft_weight_dtype=float32 (docs/configuration.md)")
    e.add_argument("--out", default="eval_draft.json", help="JSON results")
    e.add_argument("--plot", default=None, help="PNG of acceptance per position")
    e.add_argument("--quiet", action="store_true", help="no progress output")
    e.set_defaults(func=cmd_eval_draft)
    from outpace.bench import add_bench_command  # bench latency | throughput | serve
    add_bench_command(sub)
    return p


def default_openmp_wait_policy(environ=os.environ) -> None:
    """OpenMP workers sleep between parallel ops (OMP_WAIT_POLICY=PASSIVE) unless the user
    chose a policy. Set before torch loads, since OpenMP reads it once at start. Why: by default
    a worker spins after each op, and when other processes share the cores (a laptop, a CI
    machine) the spinning thread takes the core from the one doing work, so every parallel op
    waits for a time slice; a passive worker costs only a wake-up per op, and small forwards
    run on one thread anyway (models/cpu_fast_paths.cpu_threads_for). docs/decisions.md, "The
    CLI sets OMP_WAIT_POLICY=PASSIVE"."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _interrupt_outside_torch_import(signum, frame) -> None:
    """SIGINT's handler while a command runs: KeyboardInterrupt, as Python's own, except while
    torch's import runs. There a KeyboardInterrupt raised in Python code that torch's native
    initialisation called cannot unwind through it: pybind11 aborts the process ("terminate
    called after throwing ...", status -6). So the signal is sent again 50 ms later, until the
    import is over, and Ctrl-C still ends the command with its one line."""
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_name == "<module>" and f"{os.sep}torch{os.sep}" in code.co_filename:
            timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            return
        f = f.f_back
    raise KeyboardInterrupt


def main(argv=None) -> int:
    default_openmp_wait_policy()
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `outpace`: what it can do
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    # outpace's own progress at INFO; other libraries' warnings only (their INFO lines, e.g.
    # torch's at exit, are not the user's business)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("outpace").setLevel(
        logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    guard = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
             and threading.current_thread() is threading.main_thread())
    if guard:
        signal.signal(signal.SIGINT, _interrupt_outside_torch_import)
    try:
        return args.func(args)
    except OutpaceError as e:
        print(f"outpace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or starting: no traceback
        print("\noutpace: interrupted", file=sys.stderr)
        return 130
    finally:
        if guard:
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
