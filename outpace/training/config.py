"""`TrainConfig`: every option of `outpace train-draft`, frozen and validated in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from outpace.errors import ConfigError

METHODS = ("eagle3", "mtp")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")

# The options a resumed run must share with its checkpoint: they decide which batches come in
# which order and what each step computes. (epochs, lr and the schedule may change on resume:
# the run then continues, but no longer as the uninterrupted one would have.)
TRAJECTORY = ("method", "draft_vocab", "ttt_steps", "num_modules", "mtp_mode", "batch_tokens",
              "max_len", "seed", "loss_decay", "answer_tokens", "samples", "temperature",
              "top_p", "loop_tokens", "max_prompts", "holdout", "warm_start", "aux_layers",
              "init_head", "extra_answers")


@dataclass(frozen=True)
class TrainConfig:
    method: str  # "eagle3" | "mtp"
    target: str  # catalog name, HF folder or .gguf
    data: str  # training prompts (JSONL)
    out: str  # the exported head's folder (checkpoints and the answer cache inside it)
    draft_vocab: Optional[int] = None  # EAGLE-3: draft vocabulary size (None: 8192 or V)
    # EAGLE-3: the 3 target layers whose output fc fuses (None: (1, L/2-1, L-4))
    aux_layers: Optional[tuple] = None
    ttt_steps: Optional[int] = None  # training-time-test steps (None: 7 EAGLE-3, 3 MTP)
    num_modules: int = 1  # MTP modules; more than one trains depths mode
    epochs: float = 1.0
    lr: float = 5e-4
    warmup: float = 0.03  # share of the planned steps with a linear warm-up
    min_lr_ratio: float = 0.05  # the cosine schedule ends at lr * this
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    loss_decay: float = 0.8  # step i's loss weighs loss_decay ** i
    batch_tokens: int = 16384  # padded tokens per batch
    max_len: int = 2048  # sequences are cut to this many tokens
    seed: int = 0
    device: str = "auto"
    answer_tokens: int = 512  # max tokens of each self-distilled answer
    # answer tokens kept once an answer starts repeating itself verbatim (None: all of them)
    loop_tokens: Optional[int] = 64
    samples: int = 0  # sampled answers per prompt, beside the greedy one
    temperature: float = 0.8
    top_p: float = 0.95
    max_prompts: Optional[int] = None  # use only the file's first N prompts
    holdout: int = 0  # the last N prompts are held out: their TTT accuracy is reported
    save_every: int = 500  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2
    data_cache: Optional[str] = None  # the answers' JSONL (None: <out>/selfdistill.jsonl)
    # earlier runs' answer caches (other seeds): their sampled answers join the data
    extra_answers: tuple = ()
    resume: Optional[str] = None  # a checkpoint folder, or an out folder (its latest)
    max_minutes: Optional[float] = None  # a time budget for the training steps
    warm_start: bool = True  # heads start from the target's weights where roles match
    # start from this exported head (its weights; EAGLE-3: its draft vocabulary and aux layers)
    init_head: Optional[str] = None
    export_dtype: str = "bfloat16"
    # torch.compile the target's layer, the head's step and the loss (dynamic shapes): fewer,
    # fused kernels a step, after a compile at the start
    compile: bool = False
    quiet: bool = False

    def __post_init__(self):
        def bad(msg):
            raise ConfigError(msg)
        if self.method not in METHODS:
            bad(f"--method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        if self.method == "mtp" and self.draft_vocab is not None:
            bad("--draft-vocab applies to EAGLE-3 only; MTP heads share the target's LM head")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            bad(f"--draft-vocab must be >= 1, got {self.draft_vocab}")
        if self.aux_layers is not None:
            if self.method != "eagle3":
                bad("--aux-layers applies to EAGLE-3 only (an MTP head reads the last hidden "
                    "state)")
            if len(self.aux_layers) != 3 or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0
                    for i in self.aux_layers):
                bad(f"--aux-layers takes 3 target layer indices >= 0 (fc fuses 3 hidden "
                    f"states), got {list(self.aux_layers)}")
        if self.method == "eagle3" and self.num_modules != 1:
            bad(f"--num-modules applies to MTP only (an EAGLE-3 head has one layer), got "
                f"{self.num_modules}")
        if self.num_modules < 1:
            bad(f"--num-modules must be >= 1, got {self.num_modules}")
        if self.ttt_steps is not None and not 1 <= self.ttt_steps <= 16:
            bad(f"--ttt-steps must be in 1..16, got {self.ttt_steps}")
        if self.method == "mtp" and self.num_modules > 1 and self.steps != self.num_modules:
            bad(f"an MTP head of {self.num_modules} modules trains depths mode, one step a "
                f"module: --ttt-steps must be {self.num_modules} (or left out)")
        for name in ("epochs", "lr"):
            if not getattr(self, name) > 0:
                bad(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup < 1:
            bad(f"warmup must be a share of the steps in [0, 1), got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            bad(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.max_grad_norm <= 0:
            bad("weight_decay must be >= 0 and max_grad_norm > 0")
        if not 0 < self.loss_decay <= 1:
            bad(f"loss_decay must be in (0, 1], got {self.loss_decay}")
        if self.max_len < 4 or self.batch_tokens < self.max_len:
            bad(f"--max-len must be >= 4 and --batch-tokens >= --max-len (a batch holds at "
                f"least one whole sequence), got {self.max_len} and {self.batch_tokens}")
        if self.answer_tokens < 1 or self.samples < 0:
            bad("--answer-tokens must be >= 1 and --samples >= 0")
        if self.loop_tokens is not None and self.loop_tokens < 0:
            bad(f"--loop-tokens must be >= 0, got {self.loop_tokens}")
        if self.samples and not (self.temperature > 0 and 0 < self.top_p <= 1):
            bad("sampled answers need --temperature > 0 and --top-p in (0, 1]")
        if self.max_prompts is not None and self.max_prompts < 1:
            bad(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.holdout < 0 or self.save_every < 1 or self.keep_checkpoints < 1:
            bad("--holdout must be >= 0, --save-every and keep_checkpoints >= 1")
        if self.max_minutes is not None and self.max_minutes <= 0:
            bad(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.export_dtype not in EXPORT_DTYPES:
            bad(f"--export-dtype must be one of {', '.join(EXPORT_DTYPES)}")

    @property
    def steps(self) -> int:
        """TTT steps (draft positions trained)."""
        if self.ttt_steps is not None:
            return self.ttt_steps
        if self.method == "mtp":
            return self.num_modules if self.num_modules > 1 else 3
        return 7

    @property
    def mtp_mode(self) -> Optional[str]:
        if self.method != "mtp":
            return None
        return "depths" if self.num_modules > 1 else "chain"

    def trajectory(self) -> dict:
        d = dataclasses.asdict(self)
        d["ttt_steps"], d["mtp_mode"] = self.steps, self.mtp_mode
        if d["aux_layers"] is not None:  # a list once a checkpoint's JSON is read back
            d["aux_layers"] = list(d["aux_layers"])
        d["extra_answers"] = [str(f) for f in d["extra_answers"]]
        # absent when empty: checkpoints from before the option resume as they did
        return {k: d[k] for k in TRAJECTORY if k != "extra_answers" or d[k]}
