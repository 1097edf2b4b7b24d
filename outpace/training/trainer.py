"""`outpace train-draft`: self-distill, then train an EAGLE-3 or MTP head with training-time test.

    train_draft(TrainConfig(method="eagle3", target="smollm2-135m", data="prompts.jsonl",
                            out="heads/eagle3"))

1. The target answers the prompts through the engine (training/selfdistill.py; cached).
2. EAGLE-3: the draft vocabulary, the most frequent answer tokens (training/draft_vocab.py).
3. Each step: the target's features for a batch, computed on the fly (target_features.py),
   then the head unrolled over S steps (ttt.py). Step i's loss is the soft cross-entropy between
   the head's distribution and the target's at the same position (EAGLE-3: both over the draft
   vocabulary, and only where the target's greedy token is in it), over answer tokens only,
   weighted loss_decay ** i.
4. AdamW, a linear warm-up then a cosine decay, gradient clipping, bf16 autocast on CUDA;
   checkpoints every save_every steps and at the end (checkpoint.py), exact resume.
5. The head is exported into `out` (config.json + model.safetensors, heads.py), with
   training.json: the options, the loss and per-step accuracy history, the held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from outpace.errors import ConfigError
from outpace.runner_config import resolve_device
from outpace.training.batches import collate, epoch_order, plan_batches, sequences_from_records
from outpace.training.checkpoint import load_checkpoint, save_checkpoint
from outpace.training.config import TrainConfig
from outpace.training.draft_vocab import (choose_draft_vocab, count_tokens, coverage,
                                          draft_ids_of, grow_draft_vocab)
from outpace.training.heads import (export_head, grow_eagle3_head, head_from_export,
                                     new_eagle3_head, new_mtp_head)
from outpace.training.selfdistill import read_extra_answers, read_prompts, regenerate
from outpace.training.target_features import dense_layer, target_features
from outpace.training.ttt import Eagle3Unroll, MTPUnroll, unroll

DEFAULT_DRAFT_VOCAB = 8192


class TimeBudget:
    """How many training steps fit `seconds`, estimated after every step from the steps timed
    so far. A step's time follows its batch's sequence length, and batches come in random
    order, so the estimate is kept up to date rather than fixed from the first few steps. The
    first `skip` steps (kernel selection, allocator warm-up) are not timed."""

    def __init__(self, seconds: float, start_step: int, skip: int = 3, min_timed: int = 8,
                 clock=time.perf_counter):
        self.seconds, self.start_step, self.clock = seconds, start_step, clock
        self.skip, self.min_timed = skip, min_timed
        self.t0 = clock()
        self.mark = None  # (time, step) once the untimed steps are done
        self.estimates = 0
        self.per_step = None

    def total(self, step: int, planned: int):
        """After `step` steps: the run's total under the budget (at most `planned`, at least
        `step`), or None while too few steps are timed to say."""
        now = self.clock()
        if self.mark is None and step - self.start_step >= self.skip:
            self.mark = (now, step)
        if now - self.t0 >= self.seconds:
            return step
        if self.mark is None or step - self.mark[1] < self.min_timed:
            return None
        self.per_step = (now - self.mark[0]) / (step - self.mark[1])
        self.estimates += 1
        left = self.seconds - (now - self.t0)
        return max(step, min(planned, step + int(left / self.per_step)))


def lr_at(step: int, cfg: TrainConfig, total: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine from lr to lr * min_lr_ratio."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> tuple:
    """logits, target [N, V] (the head's and the target's, over the same columns) -> (the mean
    soft cross-entropy in fp32, the share of rows whose argmaxes agree)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = target.float()
    loss = -(torch.softmax(target, dim=-1) * logp).sum(-1).mean()
    acc = (logp.argmax(-1) == target.argmax(-1)).float().mean()
    return loss, acc


# Inductor's coalescing analysis for tiling asserts on the head step's dynamic shapes (a
# compile error, not a wrong result): it only picks tilings, so it stays off.
_COMPILE_OPTIONS = {"triton.coalesce_tiling_analysis": False}


class Trainer:
    """One training run; `run()` trains (or resumes) and exports. The pieces are methods so
    that tests can drive steps one at a time."""

    def __init__(self, cfg: TrainConfig, loaded=None):
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file; pass a folder for the draft head")
        self.device = torch.device(_resolve_device(cfg.device))
        # the prompt file first: a bad one is an error before a model is loaded
        prompts = read_prompts(cfg.data, limit=cfg.max_prompts)
        if cfg.holdout >= len(prompts):
            raise ConfigError(f"--holdout {cfg.holdout} leaves no training prompts of "
                              f"{len(prompts)}")
        self._load_target(loaded)
        self._load_data(prompts)
        self._build_head()
        # (target layer, head step, loss) for training steps; held-out evaluation runs eager,
        # so that no-grad graphs do not count against the compiled functions' recompile limit
        self.eager_fns = (dense_layer, self.unroll.step, soft_cross_entropy)
        self.train_fns = self.eager_fns
        if cfg.compile:
            self.train_fns = tuple(torch.compile(f, dynamic=True, options=_COMPILE_OPTIONS)
                                   for f in self.eager_fns)
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=cfg.weight_decay)
        self.planned = max(1, math.ceil(cfg.epochs * len(self.batches)))
        self.total = self.planned
        self.warmup = max(1, round(cfg.warmup * self.planned))
        self.step = 0
        self.history = []
        if cfg.resume:
            self._resume(cfg.resume)

    # ---- set-up ---------------------------------------------------------------------------
    def _load_target(self, loaded) -> None:
        from outpace.models.loader import load_model
        if loaded is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            loaded = load_model(self.cfg.target, dtype=dtype, device=self.device,
                                quiet=self.cfg.quiet)
        self.target, self.target_cfg, self.tokenizer = loaded
        for p in self.target.parameters():
            p.requires_grad_(False)

    def _load_data(self, prompts: list) -> None:
        cfg = self.cfg
        cache = Path(cfg.data_cache).expanduser() if cfg.data_cache else \
            self.out / "selfdistill.jsonl"
        records = regenerate(cfg.target, prompts, cache, loaded=(self.target, self.target_cfg,
                                                                  self.tokenizer),
                             device=str(self.device), max_tokens=cfg.answer_tokens,
                             samples=cfg.samples, temperature=cfg.temperature,
                             top_p=cfg.top_p, seed=cfg.seed, quiet=cfg.quiet)
        if cfg.extra_answers:
            extra = read_extra_answers(cfg.extra_answers, prompts, self.target_cfg,
                                       cfg.answer_tokens, cfg.temperature, cfg.top_p, cfg.seed)
            self._log(f"{len(extra)} sampled answers of earlier runs added "
                      f"({len(cfg.extra_answers)} file(s))")
            records = records + extra
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the engine's KV pool
        held = {p["id"] for p in prompts[len(prompts) - cfg.holdout:]} if cfg.holdout else set()
        train = [r for r in records if r["id"] not in held]
        self.seqs = sequences_from_records(train, cfg.max_len, cfg.loop_tokens)
        self.held_seqs = sequences_from_records([r for r in records if r["id"] in held],
                                                cfg.max_len, cfg.loop_tokens)
        if not self.seqs:
            raise ConfigError("no training sequence has two answer tokens or more; give more "
                              "prompts or a larger --answer-tokens")
        self.batches = plan_batches(self.seqs, cfg.batch_tokens)
        h = hashlib.sha256()
        for s in self.seqs:
            h.update(repr((s.ids, s.answer_start)).encode())
        self.data_digest = h.hexdigest()[:16]
        self.num_answer_tokens = sum(len(s.ids) - s.answer_start for s in self.seqs)

    def _build_head(self) -> None:
        cfg, tcfg = self.cfg, self.target_cfg
        if cfg.init_head is not None:
            self.head = head_from_export(cfg.method, cfg.init_head, self.target, tcfg,
                                         self.device)
            self._log(f"starting from the head in {cfg.init_head}")
        if cfg.method == "eagle3" and cfg.init_head is not None:
            h = self.head
            have = h.config.draft_vocab_size
            if cfg.draft_vocab is not None and cfg.draft_vocab < have:
                raise ConfigError(f"--draft-vocab {cfg.draft_vocab} is smaller than the draft "
                                  f"vocabulary of --init-head {cfg.init_head} ({have}): a "
                                  f"continued head keeps its ids; leave --draft-vocab out or "
                                  f"pass {have} or more")
            if cfg.draft_vocab is not None and cfg.draft_vocab > tcfg.vocab_size:
                raise ConfigError(f"--draft-vocab {cfg.draft_vocab} is larger than the target's "
                                  f"vocabulary ({tcfg.vocab_size})")
            if cfg.aux_layers is not None and tuple(cfg.aux_layers) != tuple(h.aux_layer_ids):
                raise ConfigError(f"--aux-layers {list(cfg.aux_layers)} differ from those of "
                                  f"--init-head {cfg.init_head} ({list(h.aux_layer_ids)}); "
                                  f"leave --aux-layers out")
            counts = count_tokens((s.ids[s.answer_start:] for s in self.seqs), tcfg.vocab_size)
            self.coverage_by_size = None
            if cfg.draft_vocab is not None and cfg.draft_vocab > have:
                # the head's ids and trained rows kept, the most frequent others added
                kept = draft_ids_of(h.d2t.cpu())  # what drafts map to: its rows' ids
                d2t, t2d = grow_draft_vocab(counts, kept, cfg.draft_vocab)
                self._log(f"draft vocabulary grown from {have} to {cfg.draft_vocab} ids: "
                          f"coverage {coverage(counts, h.t2d.cpu()):.4f} -> "
                          f"{coverage(counts, t2d):.4f} of the answer tokens")
                self.head = h = grow_eagle3_head(h, self.target, tcfg, d2t, t2d, self.device,
                                                 cfg.warm_start, cfg.seed)
            self.vocab_coverage = coverage(counts, h.t2d.cpu())
            self.unroll = Eagle3Unroll(h, self.target.embed_weight)
            self.capture = tuple(h.aux_layer_ids)
        elif cfg.method == "eagle3":
            size = cfg.draft_vocab or min(DEFAULT_DRAFT_VOCAB, tcfg.vocab_size)
            if size > tcfg.vocab_size:
                raise ConfigError(f"--draft-vocab {size} is larger than the target's "
                                  f"vocabulary ({tcfg.vocab_size})")
            counts = count_tokens((s.ids[s.answer_start:] for s in self.seqs), tcfg.vocab_size)
            d2t, t2d = choose_draft_vocab(counts, size)
            self.vocab_coverage = coverage(counts, t2d)
            # what other sizes would cover (the draft can never propose a token outside it)
            self.coverage_by_size = {n: round(coverage(counts, choose_draft_vocab(counts, n)[1]),
                                              5)
                                     for n in (1024, 2048, 4096, 8192, 16384, 32768)
                                     if n <= tcfg.vocab_size}
            self.head = new_eagle3_head(self.target, tcfg, d2t, t2d, cfg.seed, self.device,
                                        cfg.warm_start, cfg.aux_layers)
            self.unroll = Eagle3Unroll(self.head, self.target.embed_weight)
            self.capture = tuple(self.head.aux_layer_ids)
        else:
            self.vocab_coverage = self.coverage_by_size = None
            if cfg.init_head is None:
                self.head = new_mtp_head(self.target, tcfg, cfg.num_modules, cfg.seed,
                                         self.device, cfg.warm_start)
            if self.head.num_modules != cfg.num_modules:
                raise ConfigError(f"--init-head {cfg.init_head} has {self.head.num_modules} "
                                  f"modules: pass --num-modules {self.head.num_modules}")
            self.unroll = MTPUnroll(self.head, self.target, cfg.mtp_mode)
            self.capture = ()
        self.head.train()
        for name, b in self.head.named_buffers():
            b.requires_grad_(False)

    def _state(self) -> dict:
        return {"planned_steps": self.planned, "total_steps": self.total,
                "warmup_steps": self.warmup, "trajectory": self.cfg.trajectory(),
                "data_digest": self.data_digest, "history": self.history[-200:]}

    def _resume(self, path) -> None:
        state = load_checkpoint(path, self.head, self.optimizer)
        old, new = state.get("trajectory", {}), self.cfg.trajectory()
        diff = sorted(k for k in new if old.get(k) != new[k])
        if diff:
            raise ConfigError("the checkpoint was trained with other options: " + ", ".join(
                f"{k} {old.get(k)!r} there, {new[k]!r} now" for k in diff[:5]) +
                "; resume with the same options")
        if state.get("data_digest") != self.data_digest:
            raise ConfigError(f"the training data changed since checkpoint {state['path']} "
                              f"(other prompts or answers); resume with the same data")
        self.step = int(state["step"])
        if state.get("planned_steps") == self.planned:
            self.total, self.warmup = int(state["total_steps"]), int(state["warmup_steps"])
        self.history = list(state.get("history", []))
        self._log(f"resumed from {state['path']} at step {self.step} of {self.total}")

    # ---- one step -------------------------------------------------------------------------
    def batch_of(self, step: int) -> list:
        nb = len(self.batches)
        epoch, pos = divmod(step, nb)
        return self.batches[epoch_order(nb, self.cfg.seed, epoch)[pos]]

    def losses(self, seqs, idxs, grad: bool = True) -> tuple:
        """(total loss, [per-step loss], [per-step accuracy], [per-step weight]) of one batch.

        The host waits on the device a fixed number of times a batch, not per TTT step: for
        the number of rows each step trains and their indices (built for all steps at once),
        and at the end for the step losses and accuracies (kept on the device until then)."""
        ids, mask, lengths = collate(seqs, idxs, self.device)
        cfg = self.cfg
        vocab_ids = draft_ids_of(self.head.d2t) if cfg.method == "eagle3" else None
        auto = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" \
            else nullcontext()
        layer_fn, step_fn, loss_fn = self.train_fns if grad else self.eager_fns
        feats = target_features(self.target, ids, self.capture, want_hidden=cfg.method == "mtp",
                                vocab_ids=vocab_ids, layer_fn=layer_fn)
        b, t = ids.shape
        in_vocab = self.head.t2d[feats.argmax] if cfg.method == "eagle3" else None
        tgt_flat = feats.logits.reshape(b * t, -1)
        first_in = feats.aux if cfg.method == "eagle3" else feats.hidden
        # row p of step i predicts the token at p + 2 + i from the target's logits at p + 1 + i;
        # it counts where that token is an answer token (and, EAGLE-3, the target's greedy
        # token there is in the draft vocabulary)
        keep = torch.zeros((cfg.steps, b, t), dtype=torch.bool, device=ids.device)
        for i in range(min(cfg.steps, max(0, t - 2))):
            keep[i, :, :t - 2 - i] = mask[:, 2 + i:]
            if in_vocab is not None:
                keep[i, :, :t - 2 - i] &= in_vocab[:, 1 + i:t - 1]
        flat = keep.view(cfg.steps, b * t)
        counts = flat.sum(-1).tolist()  # the one wait before the steps
        sels = torch.nonzero(flat)[:, 1].split(counts)
        total = None
        step_losses, accs = [], []
        with auto, (nullcontext() if grad else torch.no_grad()):
            first = self.unroll.first_hidden(first_in.float() if self.device.type != "cuda"
                                             else first_in)
            for i, hidden in unroll(self.unroll, first, ids, cfg.steps, step_fn):
                sel, n = sels[i], counts[i]
                if n == 0:
                    step_losses.append(None)
                    accs.append(None)
                    continue
                logits = self.unroll.logits(hidden.reshape(b * t, -1).index_select(0, sel), i)
                loss, acc = loss_fn(logits, tgt_flat.index_select(0, sel + 1 + i))
                step_losses.append(loss.detach())
                accs.append(acc)
                term = loss * (cfg.loss_decay ** i)
                total = term if total is None else total + term
        done = [j for j, x in enumerate(step_losses) if x is not None]
        values = torch.stack([step_losses[j] for j in done] + [accs[j] for j in done]).tolist() \
            if done else []
        step_losses, accs = [0.0] * cfg.steps, [0.0] * cfg.steps
        for pos, j in enumerate(done):
            step_losses[j], accs[j] = values[pos], values[len(done) + pos]
        return total, step_losses, accs, counts

    def train_step(self) -> dict:
        cfg = self.cfg
        idxs = self.batch_of(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, cfg, self.total, self.warmup)
        total, step_losses, accs, weights = self.losses(self.seqs, idxs)
        if total is not None:
            total.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"step": self.step, "loss": round(float(total.detach()) if total is not None
                                               else 0.0, 5),
                "step_loss": [round(x, 4) for x in step_losses],
                "acc": [round(x, 4) for x in accs],
                "tokens": sum(len(self.seqs[i].ids) for i in idxs),
                "lr": self.optimizer.param_groups[0]["lr"]}

    @torch.no_grad()
    def evaluate_holdout(self) -> dict:
        """TTT accuracy per step over the held-out sequences (weighted by rows)."""
        if not self.held_seqs:
            return {}
        was = self.head.training
        self.head.eval()
        sums = [0.0] * self.cfg.steps
        loss_sums = [0.0] * self.cfg.steps
        counts = [0] * self.cfg.steps
        for idxs in plan_batches(self.held_seqs, self.cfg.batch_tokens):
            _, losses, accs, weights = self.losses(self.held_seqs, idxs, grad=False)
            for i, (lo, a, w) in enumerate(zip(losses, accs, weights)):
                sums[i] += a * w
                loss_sums[i] += lo * w
                counts[i] += w
        self.head.train(was)
        return {"acc": [round(s / c, 4) if c else None for s, c in zip(sums, counts)],
                "loss": [round(s / c, 4) if c else None for s, c in zip(loss_sums, counts)],
                "rows": counts}

    # ---- the run --------------------------------------------------------------------------
    def run(self, max_steps=None) -> Path:
        """Train to the end (or `max_steps` steps of this run, then stop after a checkpoint,
        as a run killed after its last checkpoint would), export, and return the folder."""
        cfg = self.cfg
        ckpt_dir = self.out / "checkpoints"
        self._log(f"{cfg.method} head for {cfg.target}: {len(self.seqs)} sequences, "
                  f"{self.num_answer_tokens} answer tokens, {len(self.batches)} batches an "
                  f"epoch, {self.total} steps, {cfg.steps} TTT steps"
                  + (f", draft vocabulary {self.head.config.draft_vocab_size} "
                     f"({100 * self.vocab_coverage:.2f}% of answer tokens)"
                     if self.vocab_coverage is not None else ""))
        from tqdm import tqdm
        bar = tqdm(total=self.total, initial=self.step, desc=f"train-draft {cfg.method}",
                   unit="step", file=sys.stderr, disable=cfg.quiet, dynamic_ncols=True,
                   mininterval=0.2 if sys.stderr.isatty() else 20)
        start = time.perf_counter()
        ema, tok_s = None, 0.0
        budget = TimeBudget(cfg.max_minutes * 60, self.step) if cfg.max_minutes else None
        first_step = self.step

        def stop_at() -> int:
            return self.total if max_steps is None else min(self.total, first_step + max_steps)

        while self.step < stop_at():
            t0 = time.perf_counter()
            rec = self.train_step()
            dt = time.perf_counter() - t0
            tok_s = rec["tokens"] / max(dt, 1e-9)
            ema = rec["acc"] if ema is None else [0.9 * e + 0.1 * a for e, a in zip(ema, rec["acc"])]
            if self.step % 10 == 0 or self.step == self.total:
                self.history.append({k: rec[k] for k in ("step", "loss", "acc", "lr")})
            if budget is not None:
                fits = budget.total(self.step, self.planned)
                if fits is not None and fits != self.total:
                    if budget.estimates == 1:
                        self._log(f"--max-minutes {cfg.max_minutes}: about {fits} steps fit "
                                  f"({budget.per_step * 1000:.0f} ms a step), of "
                                  f"{self.planned} planned")
                    self.total = fits
                    bar.total = fits
            bar.update(1)
            bar.set_postfix_str(f"loss {rec['loss']:.3f} acc "
                                + "/".join(f"{a:.2f}" for a in ema)
                                + f" {tok_s / 1000:.1f}k tok/s", refresh=False)
            if self.step % cfg.save_every == 0 and self.step < self.total:
                save_checkpoint(ckpt_dir, self.step, self.head, self.optimizer, self._state(),
                                cfg.keep_checkpoints)
        bar.close()
        save_checkpoint(ckpt_dir, self.step, self.head, self.optimizer, self._state(),
                        cfg.keep_checkpoints)
        if self.step < self.total:
            self._log(f"stopped at step {self.step} of {self.total}; --resume {self.out} "
                      f"continues")
            return self.out
        held = self.evaluate_holdout()
        export_head(self.head, self.out, getattr(torch, cfg.export_dtype))
        report = {"config": dataclasses.asdict(cfg), "steps": self.step,
                  "total_steps": self.total, "planned_steps": self.planned,
                  "train_seconds": round(time.perf_counter() - start, 1),
                  "sequences": len(self.seqs), "answer_tokens": self.num_answer_tokens,
                  "draft_vocab_coverage": self.vocab_coverage,
                  "coverage_by_size": self.coverage_by_size, "holdout": held,
                  "history": self.history}
        (self.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        if held:
            self._log("held-out TTT accuracy per step: "
                      + " ".join(f"{a:.3f}" for a in held["acc"] if a is not None))
        self._log(f"wrote the {cfg.method} head to {self.out}")
        return self.out

    def _log(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"outpace: {msg}", file=sys.stderr)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return resolve_device(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available; use --device "
                          "cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu, cuda or auto, got {device!r}")
    return device


def train_draft(cfg: TrainConfig, loaded=None) -> Path:
    """Train (or resume) a draft head as `cfg` says; -> the exported head's folder."""
    return Trainer(cfg, loaded=loaded).run()
