"""A CUDA engine limits torch's CPU threads to 1 (builder.limit_host_threads), unless the user set
OMP_NUM_THREADS: parallel CPU ops beside the engine loop left OpenMP workers spinning and slowed
the host side of every step (device machine, run 11)."""

import torch

from outpace.engine.builder import limit_host_threads


def test_limit_host_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        limit_host_threads(quiet=True)
        assert torch.get_num_threads() == 2, "the user's OMP_NUM_THREADS must win"
        monkeypatch.delenv("OMP_NUM_THREADS")
        limit_host_threads(quiet=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
