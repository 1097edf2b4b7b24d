"""The engine's host time per decode step with the device's work taken out, on the CPU machine.

At batch 128 every engine is host-bound on the device machine (a ~3 ms host step around a
~1.3 ms graph). Here a tiny random target stands in for the model and the fused step's graphs
replay as no-ops (the packed output of their one capture run stays: valid tokens, nothing
accepted), so what is timed is the engine loop around them: scheduling, chaining, input
staging, unpacking, detokenization with the real SmolLM2 tokenizer, outputs. The CPU machine's
host is ~3x faster than the device machine's, so compare configurations and versions here,
not absolute numbers.

    python benchmarks/diag_host.py [--batch 128] [--tokens 96] [--spec none,eagle3,ngram,suffix]
        [--output-kind cumulative,final_only] [--logprobs N] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class NoopGraph:
    """A captured step that replays as nothing: its outputs keep the capture run's values."""

    def __init__(self, fn):
        self.outs = fn()

    def replay(self):
        pass


def tiny_model():
    from outpace.model_config import ModelConfig
    from outpace.models.llama import LlamaForCausalLM
    cfg = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False, max_position_embeddings=4096,
                      eos_token_ids=())
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval(), cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--spec", default="none,eagle3")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--output-kind", default="cumulative,final_only")
    ap.add_argument("--logprobs", type=int, default=None, help="every request asks for these")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a CUDA engine's host (builder.limit_host_threads)
    from outpace import SamplingParams
    from outpace.engine.engine import LLMEngine
    from outpace.models.catalog import resolve_model
    from outpace.models.draft_loader import model_config_dict
    from outpace.runner.cuda_graph import GraphRunner
    from outpace.tokenizer import Tokenizer
    from outpace.training.init_draft import init_draft

    def capture(self, fn):
        g = NoopGraph(fn)
        return g, g.outs
    GraphRunner.capture = capture
    model, cfg = tiny_model()
    tok = Tokenizer.load(resolve_model("smollm2-135m", quiet=True))
    tmp = Path(tempfile.mkdtemp())
    (tmp / "target").mkdir()
    (tmp / "target" / "config.json").write_text(json.dumps(model_config_dict(cfg)))
    for name, kind in [(n, k) for n in args.spec.split(",")
                       for k in args.output_kind.split(",")]:
        sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                            output_kind=kind, logprobs=args.logprobs)
        spec = None
        if name in ("ngram", "suffix"):  # model-free: drafted on the host after the copy
            spec = {"method": name, "num_speculative_tokens": 4}
        elif name != "none":
            head = init_draft(name, str(tmp / "target"), tmp / name, seed=0, quiet=True)
            spec = {"method": name, "model": str(head), "num_speculative_tokens": 4,
                    "force_accept_mean": 3.0, "k_schedule": [[32, 4], [64, 1]]}
        eng = LLMEngine.from_args("tiny", loaded=(model, cfg, tok), device="cpu",
                                  dtype="float32", max_num_seqs=args.batch,
                                  num_kv_blocks=args.batch * (args.tokens + 64) // 16 + 64,
                                  block_size=16, overlap=True, quiet=True,
                                  speculative_config=spec, enable_prefix_caching=False)
        eng.runner.enable_cuda_graphs((1, 2, 3, 4, 5) if spec else (1,), capture_fused=True)

        def run():
            for i in range(args.batch):
                eng.add_request(f"r{i}-{time.monotonic_ns()}",
                                [1 + (i * 7 + j) % 90 for j in range(24)], sp)
            times = []
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            # the median step is a decode step (the prefill steps are a few of ~100)
            return 1000 * statistics.median(times), 1000 * sum(times) / len(times)

        run()
        res = [run() for _ in range(3)]
        print(f"{name} {kind}: batch {args.batch}: host ms per step, median "
              f"{[round(r[0], 3) for r in res]}, mean {[round(r[1], 3) for r in res]}",
              flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            run()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue())


if __name__ == "__main__":
    main()
