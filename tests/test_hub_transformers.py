"""HuggingFace interop against transformers itself: a folder from our save_pretrained loads in
transformers' xLSTMForCausalLM with the same logits, and a folder from transformers'
save_pretrained (single or fused weights, sharded) loads in ours with the same logits.

transformers' model crashes on CPU when the q/k head dim differs from the v head dim (its cache
and the xlstm package's kernels), so these models use qk_dim_factor = v_dim_factor; the 7B case
(qk 0.5) is covered against our float64 reference of the block in the large-family tests.
"""
import json

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

from .test_hub import noisy as noisy_

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)

transformers = pytest.importorskip("transformers")

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, d_model=64, n_blocks=2, n_heads=2, qk_dim_factor=1.0, v_dim_factor=1.0,
             ffn_proj_factor=1.5, round_proj_to=16)


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens, use_cache=False).logits


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kw", [dict(), dict(bias=True, tie_embeddings=True),
                                # 48 x 2.667 = 128.02: a width just past a multiple, which the 7B's own
                                # rounding keeps at 128 (as large-125M's 768 x 2.667 stays 2048)
                                dict(d_model=48, ffn_proj_factor=2.667)])
def test_our_folder_loads_in_transformers_with_the_same_logits(tmp_path, kw):
    # float32 only: transformers' model returns float32 logits from a float64 model too
    ours = noisy_(XLSTMLanguageModel(XLSTMConfig(family="large", **{**SHAPE, **kw}))).eval()
    ours.save_pretrained(tmp_path / "hf")
    hf = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.weight_mode == "single" and hf.config.tie_word_embeddings == ours.config.tie_embeddings
    tokens = torch.randint(0, VOCAB, (2, 37))  # not a multiple of the chunk size
    with torch.no_grad():
        ref = ours(tokens)
    assert torch.isfinite(ref).all() and ref.std() > 0.1
    assert rel(hf_logits(hf, tokens), ref) < 1e-5


def test_transformers_folder_loads_in_ours_with_the_same_logits(tmp_path):
    cfg = transformers.xLSTMConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=2,
                                   qk_dim_factor=1.0, v_dim_factor=1.0, ffn_proj_factor=1.5,
                                   ffn_round_up_to_multiple_of=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    torch.manual_seed(1)
    hf = noisy_(transformers.xLSTMForCausalLM(cfg)).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = XLSTMLanguageModel.from_pretrained(tmp_path / "hf")
    assert ours.config.family == "large" and ours.config.d_model == 64
    assert ours.hf_special_tokens.bos_token_id == 0 and ours.hf_special_tokens.eos_token_id == 2
    tokens = torch.randint(0, VOCAB, (2, 29))
    with torch.no_grad():
        ref = hf_logits(hf, tokens)
        assert rel(ours(tokens), ref) < 1e-5
    # and back: our folder of it loads in transformers with the same logits and token ids
    ours.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (0, 2, 1)
    again = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert rel(hf_logits(again, tokens), ref) < 1e-5


def test_greedy_generation_matches_transformers(tmp_path):
    ours = noisy_(XLSTMLanguageModel(XLSTMConfig(family="large", **SHAPE)), scale=0.2).eval()
    ours.save_pretrained(tmp_path / "hf")
    hf = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.randint(0, VOCAB, (1, 7))
    want = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    got = ours.generate(prompt, max_new_tokens=8, temperature=0)
    assert want.shape == got.shape == (1, 15)
    assert torch.equal(got, want)


def test_generation_stops_where_transformers_stops(tmp_path):
    """The folder's end tokens (config.json, then generation_config.json with a list) end a
    greedy generation by default at the same token as transformers' generate."""
    ours = noisy_(XLSTMLanguageModel(XLSTMConfig(family="large", **SHAPE)), scale=0.2).eval()
    ours.save_pretrained(tmp_path / "hf")
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    free = ours.generate(prompt, max_new_tokens=10, temperature=0)[0, 7:].tolist()
    assert len(set(free)) > 2  # varied tokens: the end token falls mid-way
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    others = [t for t in free if t != free[4]]
    for ends, gen_config in ((free[4], None), (free[6], [others[0], VOCAB - 1])):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "eos_token_id": ends, "pad_token_id": 0}))
        if gen_config is not None:
            transformers.GenerationConfig(eos_token_id=gen_config, pad_token_id=0).save_pretrained(tmp_path / "hf")
        hf = transformers.xLSTMForCausalLM.from_pretrained(tmp_path / "hf").eval()
        want = hf.generate(prompt, max_new_tokens=10, do_sample=False)
        got = XLSTMLanguageModel.from_pretrained(tmp_path / "hf").generate(prompt, max_new_tokens=10, temperature=0)
        assert want.shape[1] < 17
        assert torch.equal(got, want)


def test_fused_weights_of_the_official_model_load_with_the_same_logits(tmp_path):
    """weight_mode "fused" (q|k|v|o, i|f and the SwiGLU up maps each one matrix): transformers
    cannot build such a model (its initialisation fails), so the official xLSTMLarge provides
    the weights and the logits; the folder is what transformers' save_pretrained would write."""
    from safetensors.torch import save_file

    official = pytest.importorskip("xlstm.xlstm_large.model")
    cfg = official.xLSTMLargeConfig(
        embedding_dim=64, num_heads=2, num_blocks=2, vocab_size=VOCAB, qk_dim_factor=1.0, v_dim_factor=1.0,
        ffn_proj_factor=1.5, ffn_round_up_to_multiple_of=16, weight_mode="fused", mode="inference",
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", return_last_states=True, autocast_kernel_dtype="float32")
    ref_model = noisy_(official.xLSTMLarge(cfg)).eval()
    state = {("backbone.embeddings.weight" if k == "embedding.weight" else k): v.contiguous()
             for k, v in ref_model.state_dict().items()}
    assert any("qkv_opreact" in k for k in state)
    (tmp_path / "fused").mkdir()
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = transformers.xLSTMConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=2,
                                      qk_dim_factor=1.0, v_dim_factor=1.0, ffn_proj_factor=1.5,
                                      ffn_round_up_to_multiple_of=16, weight_mode="fused")
    hf_cfg.save_pretrained(tmp_path / "fused")
    ours = XLSTMLanguageModel.from_pretrained(tmp_path / "fused")
    tokens = torch.randint(0, VOCAB, (2, 29))
    with torch.no_grad():
        ref = ref_model(tokens)[0]
        assert rel(ours(tokens), ref) < 1e-5
