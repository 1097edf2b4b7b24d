"""Our decoder, loaded from a saved HF checkpoint, gives transformers' logits (fp32, CPU)."""

import copy

import pytest
import torch

from outpace.kernels.options import use_kernel_options
from outpace.models.loader.safetensors import load_hf_folder
from outpace.runner_config import KernelOptions
from tests.models.helpers import PagedRunner, hf_logits, tiny_hf

FAMILIES = ["llama", "llama_bias", "llama3_rope", "mistral", "qwen2", "qwen3", "smollm2"]
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    hf = tiny_hf(request.param, seed=FAMILIES.index(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)  # safetensors
    ours, cfg = load_hf_folder(folder, quiet=True)
    return request.param, hf, ours, cfg


def test_config_matches_family(pair):
    family, hf, ours, cfg = pair
    assert cfg.architecture == {"llama_bias": "llama", "llama3_rope": "llama",
                                "smollm2": "llama"}.get(family, family)
    assert cfg.tie_word_embeddings == (family == "smollm2")
    assert cfg.qk_norm == (family == "qwen3")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if family == "llama3_rope"
                                                         else None)
    if family == "smollm2":
        assert ours.lm_head_weight is ours.embed_weight


def test_full_prefill(pair):
    _, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    ref, ref_hidden = hf_logits(hf, ids.tolist(), output_hidden_states=True)
    runner = PagedRunner(ours, num_seqs=1)
    capture = (0, cfg.num_hidden_layers - 2)
    logits, aux = runner.step({0: ids.tolist()}, capture_layers=capture)
    assert ref.abs().max() > 1.0  # the weights are not so small that everything matches trivially
    assert (logits - ref).abs().max().item() <= TOL
    assert len(aux) == len(capture)
    for i, a in zip(capture, aux):  # layer i's output is HF's hidden_states[i + 1]
        assert (a - ref_hidden[i + 1]).abs().max().item() <= TOL


def test_prefill_then_decode(pair):
    _, hf, ours, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    ids = ids.tolist()
    ref = hf_logits(hf, ids)
    runner = PagedRunner(ours, num_seqs=1)
    got = [runner.step({0: ids[:13]})[0]]
    got += [runner.step({0: ids[13:20]})[0]]  # a second prefill chunk reads cached KV
    for t in ids[20:]:  # single-token decode steps
        got.append(runner.step({0: [t]})[0])
    assert (torch.cat(got) - ref).abs().max().item() <= TOL


def test_two_sequences_packed(pair):
    _, hf, ours, cfg = pair
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, cfg.vocab_size, (21,), generator=g).tolist()
    b = torch.randint(0, cfg.vocab_size, (9,), generator=g).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    runner = PagedRunner(ours, num_seqs=2)
    la = runner.step({0: a[:17], 1: b[:5]})[0]  # two prefills in one forward
    mixed = runner.step({0: a[17:18], 1: b[5:]})[0]  # a decode and a prefill chunk together
    lb = runner.step({1: [], 0: a[18:]})[0]
    got_a = torch.cat([la[:17], mixed[:1], lb])
    got_b = torch.cat([la[17:], mixed[1:]])
    assert (got_a - ref_a).abs().max().item() <= TOL
    assert (got_b - ref_b).abs().max().item() <= TOL


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["rope-kernel", "qkv-rope-store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_forward_matches(pair, monkeypatch, dtype, fused_qkv):
    """The CUDA forward (MLP residual add fused into the next layer's norm; rope inside the
    backend, fused with the KV store there) gives the same logits and captured layers as the
    CPU forward: run here with the reference kernels; on the GPU the Triton ones (tests/gpu).
    bf16 differs by rounding only: the kernels' rope rounds once, the CPU one per op."""
    import outpace.models.llama as llama
    family, hf, ours, cfg = pair
    model = copy.deepcopy(ours).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(3))
    ids = ids.tolist()
    # out of order and one layer twice (EAGLE-3's default aux ids on a 4-layer model: 1, 1, 0)
    capture = (cfg.num_hidden_layers - 2, 0, cfg.num_hidden_layers - 2)

    def run():
        runner = PagedRunner(model, num_seqs=1)
        out = [runner.step({0: ids[:17]}, capture_layers=capture)]
        out += [runner.step({0: [t]}, capture_layers=capture) for t in ids[17:]]
        return torch.cat([o[0] for o in out]), [torch.cat(a) for a in zip(*[o[1] for o in out])]

    ref_logits, ref_aux = run()
    import outpace.models.rotary as rotary
    for mod in (llama, rotary):  # the CUDA code path (rope tables read by the kernels)
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    calls = []
    fused_calls = []
    orig_fused = llama.norm_qkv_rope_store
    monkeypatch.setattr(llama, "norm_qkv_rope_store",
                        lambda *a: fused_calls.append(1) or orig_fused(*a))
    for name in ("_forward_fused_norms", "_forward_few_rows"):  # prefill, decode steps
        orig = getattr(llama.LlamaForCausalLM, name)
        monkeypatch.setattr(llama.LlamaForCausalLM, name,
                            lambda *a, _n=name, _f=orig: calls.append(_n) or _f(*a))
    with use_kernel_options(KernelOptions(fused_qkv_rope_store=fused_qkv)):
        logits, aux = run()
    few_rows_ok = family not in ("llama_bias", "qwen2")  # the few-row kernels have no bias
    assert calls.count("_forward_few_rows") == (len(ids) - 17 if few_rows_ok else 0), calls
    fused_ok = few_rows_ok and fused_qkv and family != "qwen3"  # (q/k norm sits before rope)
    assert len(fused_calls) == (cfg.num_hidden_layers * (len(ids) - 17) if fused_ok else 0)
    if few_rows_ok:  # a few-row step's captured layers come side by side (EAGLE-3 reads them
        # as one [T, 3H] input, no concatenation)
        from outpace.models.eagle3 import side_by_side
        runner = PagedRunner(model, num_seqs=1)
        runner.step({0: ids[:17]}, capture_layers=capture)
        step_aux = runner.step({0: ids[17:19]}, capture_layers=capture)[1]
        joined = side_by_side(step_aux)
        assert joined is not None and torch.equal(joined, torch.cat(step_aux, dim=-1))
    exact, exact_hidden = hf_logits(hf, ids, output_hidden_states=True)  # fp32 transformers
    if dtype == torch.float32:
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        for a, b in zip(aux, ref_aux):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert (logits - exact).abs().max().item() <= TOL
    else:  # as close to fp32 as the CPU bf16 forward is (a broken path is off by O(1))
        for got, ref, want in [(logits, ref_logits, exact)] + [
                (a, b, exact_hidden[i + 1]) for i, a, b in zip(capture, aux, ref_aux)]:
            err, ref_err = ((x.float() - want).abs().max().item() for x in (got, ref))
            assert err <= 2 * ref_err + 1e-2, (err, ref_err)


def test_greedy_tokens_is_argmax_of_logits(pair):
    _, _, ours, cfg = pair
    hidden = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(ours).to(dtype)
        h = hidden.to(dtype)
        assert torch.equal(m.greedy_tokens(h), m.compute_logits(h).argmax(dim=-1))
