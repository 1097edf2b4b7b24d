"""train-draft's compiled step (TrainConfig.compile) on the GPU: the same losses as the eager
step, batch after batch, for EAGLE-3 and MTP, under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from tests.speculative.spec_helpers import write_prompt_file
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", 24, 40)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_compiled_steps_match_eager_ones(cuda_loaded, prompts, tmp_path, method):
    from outpace.training.config import TrainConfig
    from outpace.training.trainer import Trainer
    runs = {}
    for compiled in (False, True):
        cfg = TrainConfig(method=method, target="tiny", data=str(prompts),
                          out=str(tmp_path / f"h{compiled}"),
                          draft_vocab=48 if method == "eagle3" else None, answer_tokens=24,
                          batch_tokens=256, max_len=64, epochs=2, lr=3e-3, ttt_steps=4,
                          data_cache=str(tmp_path / "answers.jsonl"), device="cuda", quiet=True,
                          compile=compiled)
        tr = Trainer(cfg, loaded=cuda_loaded)
        runs[compiled] = [tr.train_step() for _ in range(6)]
    for eager, comp in zip(runs[False], runs[True]):
        assert comp["loss"] == pytest.approx(eager["loss"], rel=5e-2), (eager, comp)
        assert comp["tokens"] == eager["tokens"]
    # the steps learn: the last losses are below the first
    assert runs[True][-1]["loss"] < runs[True][0]["loss"]
