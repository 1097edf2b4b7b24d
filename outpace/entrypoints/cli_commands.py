"""What each `outpace` command does once its flags are parsed (entrypoints/cli.py builds the
parser and dispatches to the `cmd_*` here): generate and chat stream from an engine, serve runs
the OpenAI server, init-draft / train-draft / eval-draft call training/."""

from __future__ import annotations

import sys
import time

from outpace.entrypoints.cli_options import (SAMPLING_FLAGS, SERVER_FLAGS, engine_args,
                                             engine_flags, load_engine, sampling_params,
                                             spec_options)
from outpace.errors import ConfigError, OutpaceError, spelled


def _stream(engine, request_id: str, prompt_ids: list, params, out) -> tuple:
    """Run one request to the end, writing its text to `out` as it grows -> (its last output,
    whether Ctrl-C stopped it: the request is then aborted and its text so far kept)."""
    engine.add_request(request_id, prompt_ids, params)
    shown, last, t0 = 0, None, time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != request_id:
                    continue
                out.write(o.text[shown:])
                out.flush()
                shown = len(o.text)
                last = o
        interrupted = False
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        while engine.has_unfinished_requests():  # let the engine release it
            engine.step()
        out.write(" [interrupted]")
        interrupted = True
    out.write("\n")
    if last is not None:
        last.metrics["wall_s"] = time.perf_counter() - t0
    return last, interrupted


def _print_stats(o, err) -> None:
    n = len(o.token_ids)
    wall = o.metrics.get("wall_s", 0.0)
    s = o.spec_stats
    err.write(f"[{n} tokens in {wall:.2f} s, {n / max(wall, 1e-9):.1f} tok/s")
    if s is not None and s.num_drafts:
        per = ", ".join(f"{v / s.num_drafts:.2f}" for v in s.accepted_per_position)
        err.write(f"; mean acceptance length {s.mean_acceptance_length:.2f}, "
                  f"drafts {s.num_drafts}, draft tokens {s.num_draft_tokens}, "
                  f"accepted {s.num_accepted_tokens}, acceptance per position [{per}]")
    err.write("]\n")


def _prompt_ids(engine, text: str, raw: bool) -> list:
    tok = engine.tokenizer
    if raw or not tok.has_chat_template:
        return tok.encode(text)
    return tok.chat_token_ids([{"role": "user", "content": text}], add_generation_prompt=True)


def cmd_generate(a) -> int:
    params = sampling_params(a)
    engine = load_engine(a)
    try:
        final, interrupted = _stream(engine, "cli-0", _prompt_ids(engine, a.prompt, a.raw),
                                     params, sys.stdout)
    except OutpaceError as e:  # the prompt and --max-tokens against the context
        raise spelled(e, SAMPLING_FLAGS) from None
    if final is not None and (a.spec_stats or not a.quiet):
        _print_stats(final, sys.stderr)
    return 130 if interrupted else 0


def cmd_chat(a) -> int:
    params = sampling_params(a)
    return run_chat(load_engine(a), params, a.spec_stats)


def run_chat(engine, params, spec_stats: bool = False, read=input, out=None, err=None) -> int:
    """The chat loop over `engine`: `read(prompt)` gives each line (Ctrl-D or Ctrl-C there
    leave); Ctrl-C during an answer stops it and the conversation goes on; a conversation
    that fills the context says to /reset."""
    import dataclasses
    out, err = out or sys.stdout, err or sys.stderr
    tok = engine.tokenizer
    messages, turn = [], 0
    print("outpace chat: type a message, /reset to start over, /exit or Ctrl-D to leave.",
          file=out)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = tok.chat_token_ids(messages, add_generation_prompt=True)
            room = engine.max_model_len - len(ids)
            if room < 1:
                messages.pop()
                print(f"(the conversation fills the context: {len(ids)} tokens with this "
                      f"message, of {engine.max_model_len}; /reset starts a new one, /exit "
                      f"leaves)", file=err)
                continue
            # the answer may take what is left of the context, at most --max-tokens
            turn_params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            final, interrupted = _stream(engine, f"chat-{turn}", ids, turn_params, out)
        except KeyboardInterrupt:  # before the answer started: the message is dropped
            messages.pop()
            print("\n(stopped; type the next message, /reset or /exit)", file=err)
            continue
        except OutpaceError as e:
            messages.pop()
            print(f"outpace: error: {spelled(e, SAMPLING_FLAGS)}\n(/reset starts a new "
                  f"conversation)", file=err)
            continue
        turn += 1
        # an interrupted answer stays in the conversation as far as it got
        messages.append({"role": "assistant", "content": final.text if final else ""})
        if interrupted:
            print("(stopped; the conversation goes on: type the next message, /reset or /exit)",
                  file=err)
        elif spec_stats and final is not None:
            _print_stats(final, err)
        if final is not None and len(ids) + len(final.token_ids) >= engine.max_model_len:
            print(f"(the context is full: {engine.max_model_len} tokens; /reset starts a new "
                  f"conversation)", file=err)


def cmd_serve(a) -> int:
    from outpace.config import ServerConfig
    if a.engine_process is False and a.api_server_count > 1:
        raise spelled(ConfigError("api_server_count above 1 runs the engine in a process of "
                                  "its own; leave out --no-engine-process, or set "
                                  "api_server_count to 1", option="api_server_count"),
                      SERVER_FLAGS)
    try:
        server_cfg = ServerConfig(host=a.host, port=a.port, api_key=a.api_key,
                                  served_model_name=a.served_model_name,
                                  timeout_keep_alive=a.timeout_keep_alive,
                                  api_server_count=a.api_server_count,
                                  engine_process=a.engine_process)
    except OutpaceError as e:
        raise spelled(e, SERVER_FLAGS) from None
    args = engine_args(a, max_waiting_requests=a.max_waiting)
    from outpace.entrypoints.openai.listen import bind_socket
    try:  # bound before the model loads: a port in use is an error at once
        sock = bind_socket(server_cfg.host, server_cfg.port)
    except OutpaceError as e:
        raise spelled(e, SERVER_FLAGS) from None
    from outpace.entrypoints.openai.server import run_server
    try:
        with sock:
            run_server(args, server_cfg, sock=sock,
                       log_level="warning" if getattr(a, "quiet", False) else "info")
    except OutpaceError as e:
        raise spelled(e, engine_flags(a)) from None
    return 0


def cmd_init_draft(a) -> int:
    from outpace.training.init_draft import init_draft
    init_draft(a.method, a.target, a.out, seed=a.seed, quiet=a.quiet,
               num_layers=a.num_layers)
    return 0


def cmd_train_draft(a) -> int:
    from outpace.training.config import TrainConfig
    from outpace.training.trainer import train_draft
    cfg = TrainConfig(method=a.method, target=a.target, data=a.data, out=a.out,
                      draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps,
                      aux_layers=tuple(a.aux_layers) if a.aux_layers else None,
                      num_modules=a.num_modules, epochs=a.epochs, lr=a.lr, seed=a.seed,
                      device=a.device, batch_tokens=a.batch_tokens, max_len=a.max_len,
                      answer_tokens=a.answer_tokens, samples=a.samples,
                      temperature=a.temperature, loop_tokens=None if a.loop_tokens < 0
                      else a.loop_tokens, max_prompts=a.max_prompts, holdout=a.holdout,
                      save_every=a.save_every, data_cache=a.data_cache, resume=a.resume,
                      extra_answers=tuple(a.extra_answers),
                      max_minutes=a.max_minutes, warmup=a.warmup, init_head=a.init_head,
                      compile=a.compile, quiet=a.quiet)
    train_draft(cfg)
    return 0


def cmd_eval_draft(a) -> int:
    from outpace.training.evaluate import eval_draft, plot_acceptance, result_table
    options = spec_options(a.spec_option)
    owned = {"method": "--method", "num_speculative_tokens": "--k", "model": "--draft"}
    for key in owned.keys() & options.keys():
        raise OutpaceError(f"--spec-option {key}: eval-draft sets it from {owned[key]}")
    sets = {}
    for item in a.prompts:
        name, sep, path = item.partition("=")
        if not sep:
            from pathlib import Path
            name, path = Path(item).stem, item
        sets[name] = path
    result = eval_draft(a.method, a.draft, a.target, sets, ks=a.k, max_tokens=a.max_tokens,
                        max_prompts=a.max_prompts, device=a.device, dtype=a.dtype,
                        max_num_seqs=a.max_num_seqs, out_json=a.out, quiet=a.quiet,
                        spec_options=options or None)
    # the result is printed with --quiet too: it drops progress only
    png = plot_acceptance(result, a.plot, quiet=True) if a.plot else None
    print("\n".join(result_table(result)))
    print(f"results: {a.out}")
    if a.plot:
        print(f"plot: {png}" if png is not None else
              "plot: none (matplotlib is not installed: pip install matplotlib)")
    return 0
