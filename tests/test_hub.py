"""xlstm_kit.io.hf: HuggingFace-format folders (config and weight-name mapping, the lazy sharded
loader, dtype/device per tensor, clear errors) and tokenizers-format tokenizer.json files.
transformers itself is exercised in test_hub_transformers.py."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.io import hf as hub
from xlstm_kit.io import tokenizers as tokenizers_mod
from xlstm_kit.io.tokenizers import HFSpecialTokens
from xlstm_kit.errors import XLSTMKitError

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)

VOCAB = 96


def large_config(**kw):
    base = dict(family="large", vocab_size=VOCAB, d_model=32, n_blocks=2, n_heads=2, qk_dim_factor=0.5,
                v_dim_factor=1.0, ffn_proj_factor=1.5, round_proj_to=16)
    return XLSTMConfig(**{**base, **kw})


def noisy(m, scale=0.1):
    """Weights moved off their initial values (zeros, ones, constants) so that a mix-up shows."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn_like(p))
    return m


def large_model(**kw):
    return noisy(XLSTMLanguageModel(large_config(**kw)))


def assert_same_model(a, b):
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    tokens = torch.randint(0, a.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(a(tokens), b(tokens))


# ------------------------------------------------------------------------------------- config
def test_config_round_trips_through_hf_fields():
    cfg = large_config(bias=True, tie_embeddings=True, gate_soft_cap=12.0, logit_soft_cap=25.0, norm_eps=1e-5,
                       qk_dim_factor=0.25, chunk_size=32)
    d = hub.config_to_hf(cfg, HFSpecialTokens(0, 2, 1))
    assert d["model_type"] == "xlstm" and d["architectures"] == ["xLSTMForCausalLM"]
    assert (d["hidden_size"], d["embedding_dim"], d["num_hidden_layers"], d["num_blocks"]) == (32, 32, 2, 2)
    assert (d["use_bias"], d["tie_word_embeddings"], d["output_logit_soft_cap"], d["ffn_round_up_to_multiple_of"]) \
        == (True, True, 25.0, 16)
    back, special, mode = hub.config_from_hf(json.loads(json.dumps(d)))
    assert mode == "single" and special == HFSpecialTokens(0, 2, 1)
    # context_length is not an HF field; everything that shapes the model survives
    assert back == XLSTMConfig(**{**cfg.to_dict(), "context_length": back.context_length})


def test_config_from_hf_defaults_are_xlstm_7b():
    """An HF config with only model_type means transformers' defaults: NX-AI/xLSTM-7b's shapes."""
    cfg, special, mode = hub.config_from_hf({"model_type": "xlstm"})
    ref = XLSTMConfig.from_name("xlstm-7b")
    for f in ("vocab_size", "d_model", "n_blocks", "n_heads", "qk_dim_factor", "v_dim_factor", "ffn_dim",
              "gate_soft_cap", "logit_soft_cap", "norm_eps", "bias", "tie_embeddings"):
        assert getattr(cfg, f) == getattr(ref, f), f
    assert special == HFSpecialTokens(None, None, None) and mode == "single"
    # xLSTM-7b's own config.json spells the sizes embedding_dim / num_blocks, names its GPU kernels
    # and more fields of the official package (ignored: they choose kernels, not the model)
    nxai = {"model_type": "xlstm", "architectures": ["xLSTMForCausalLM"], "embedding_dim": 4096, "num_blocks": 32,
            "num_heads": 8, "vocab_size": 50304, "qk_dim_factor": 0.5, "v_dim_factor": 1.0, "ffn_proj_factor": 2.667,
            "ffn_round_up_to_multiple_of": 64, "chunkwise_kernel": "chunkwise--triton_xl_chunk",
            "sequence_kernel": "native_sequence__triton", "step_kernel": "triton", "mode": "inference",
            "autocast_kernel_dtype": "bfloat16", "inference_state_dtype": "float32", "torch_dtype": "bfloat16",
            "force_bos_token_insert": True, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
    cfg, special, _ = hub.config_from_hf(nxai)
    assert special == HFSpecialTokens(0, 2, 1)
    with torch.device("meta"):
        mine, preset = XLSTMLanguageModel(cfg), XLSTMLanguageModel(ref)
    assert {k: v.shape for k, v in mine.state_dict().items()} == {k: v.shape for k, v in preset.state_dict().items()}
    assert 6.8e9 < mine.num_parameters() < 7.0e9
    cfg, _, mode = hub.config_from_hf({"model_type": "xlstm", "embedding_dim": 64, "num_blocks": 3,
                                       "num_heads": 4, "weight_mode": "fused", "eos_token_id": [2, 5]})
    assert (cfg.d_model, cfg.n_blocks, mode) == (64, 3, "fused")


@pytest.mark.parametrize("change, words", [
    (dict(add_out_norm=False), "add_out_norm"),
    (dict(norm_reduction_force_float32=False), "norm_reduction_force_float32"),
    (dict(eps=1e-4), "eps"),
    (dict(weight_mode="packed"), "weight_mode"),
    (dict(hidden_size=64, embedding_dim=32), "disagree"),
    (dict(num_hidden_layers=2, num_blocks=3), "disagree"),
    (dict(gate_soft_cap=None), "gate_soft_cap"),
    (dict(num_heads=3), "cannot build"),
    (dict(bos_token_id=-1), "bos_token_id"),
    (dict(model_type="llama"), "not a HuggingFace xLSTM"),
])
def test_config_from_hf_refuses_what_it_cannot_represent(change, words):
    d = {**hub.config_to_hf(large_config()), **change}
    with pytest.raises(XLSTMKitError, match=words):
        hub.config_from_hf(d, "some/config.json")


def test_key_mapping_is_a_bijection_on_the_model():
    m = XLSTMLanguageModel(large_config(bias=True))
    keys = list(m.state_dict())
    hf = [hub.our_key_to_hf(k) for k in keys]
    assert "backbone.embeddings.weight" in hf and "backbone.out_norm.weight" in hf and "lm_head.weight" in hf
    assert "backbone.blocks.1.mlstm_layer.igate_preact.bias" in hf
    assert all(k == "lm_head.weight" or k.startswith("backbone.") for k in hf)
    assert [hub.hf_key_to_ours(k) for k in hf] == keys
    assert hub.hf_key_to_ours("model.layers.0.weight") is None
    with pytest.raises(XLSTMKitError):
        hub.our_key_to_hf("blocks_x")


# ------------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("kw", [dict(), dict(bias=True, tie_embeddings=True)])
def test_hf_save_and_load_round_trip(tmp_path, kw):
    m = large_model(**kw)
    m.save_pretrained(tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [".xlstm-kit-files.json", "config.json",
                                                                    "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    # transformers' model never ties its head, so a tied one is stored too
    assert "lm_head.weight" in stored and set(stored) == {hub.our_key_to_hf(k) for k in m.state_dict()}
    loaded = XLSTMLanguageModel.from_pretrained(tmp_path / "hf")
    assert not loaded.training
    assert all(p.requires_grad for p in loaded.parameters())
    if not m.config.tie_embeddings:
        assert_same_model(m, loaded)
    else:
        # ... and read back as transformers computes: with the stored head (untied); without
        # a stored head the model is tied
        assert not loaded.config.tie_embeddings
        tokens = torch.randint(0, VOCAB, (2, 9))
        with torch.no_grad():
            assert torch.equal(m(tokens), loaded(tokens))
        del stored["lm_head.weight"]
        save_file(stored, str(tmp_path / "hf" / "model.safetensors"))
        tied = XLSTMLanguageModel.from_pretrained(tmp_path / "hf")
        assert tied.lm_head.weight is tied.embedding.weight
        assert_same_model(m, tied)


def test_sharded_folder_loads_like_the_single_file(tmp_path):
    m = large_model()
    m.save_pretrained(tmp_path / "one")
    m.save_pretrained(tmp_path / "many", max_shard_size="8KB")
    files = sorted(p.name for p in (tmp_path / "many").iterdir() if not p.name.startswith("."))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 3 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in m.state_dict().values())
    for f in shards:  # each shard stays under the limit unless it holds a single larger tensor
        held = load_file(str(tmp_path / "many" / f))
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 8000
    one = XLSTMLanguageModel.from_pretrained(tmp_path / "one")
    many = XLSTMLanguageModel.from_pretrained(tmp_path / "many")
    assert_same_model(one, many)
    assert_same_model(m, many)
    # saving again into the folder with another shard count leaves no stale shard behind
    m.save_pretrained(tmp_path / "many")
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == [".xlstm-kit-files.json", "config.json",
                                                                      "model.safetensors"]
    assert_same_model(m, XLSTMLanguageModel.from_pretrained(tmp_path / "many"))


def test_fused_weight_mode_is_split_on_load(tmp_path):
    """weight_mode "fused" folders store q|k|v|o, i|f and the two SwiGLU up maps as one matrix each."""
    m = large_model(bias=True)
    m.save_pretrained(tmp_path / "single")
    single = load_file(str(tmp_path / "single" / "model.safetensors"))
    fused = {}
    for k, t in single.items():
        for fused_name, parts in (("qkv_opreact", ("q", "k", "v", "ogate_preact")),
                                  ("ifgate_preact", ("igate_preact", "fgate_preact")),
                                  ("proj_up_gate_z", ("proj_up_gate", "proj_up"))):
            stem, _, kind = k.rpartition(".")
            parent, _, leaf = stem.rpartition(".")
            if leaf == parts[0]:
                fused[f"{parent}.{fused_name}.{kind}"] = torch.cat([single[f"{parent}.{p}.{kind}"] for p in parts])
        if not any(f".{p}." in k for p in ("q", "k", "v", "ogate_preact", "igate_preact", "fgate_preact",
                                           "proj_up_gate", "proj_up")):
            fused[k] = t
    (tmp_path / "fused").mkdir()
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "single" / "config.json").read_text())
    (tmp_path / "fused" / "config.json").write_text(json.dumps({**cfg, "weight_mode": "fused"}))
    assert len(fused) < len(single)
    assert_same_model(m, XLSTMLanguageModel.from_pretrained(tmp_path / "fused"))


def test_our_checkpoints_and_run_folders_load_too(tmp_path):
    m = noisy(XLSTMLanguageModel(XLSTMConfig(vocab_size=VOCAB, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1])))
    m.save_pretrained(tmp_path / "ours", format="xlstm_kit")
    assert (tmp_path / "ours" / "checksums.json").is_file()  # = model.save
    loaded = XLSTMLanguageModel.from_pretrained(tmp_path / "ours")
    assert_same_model(m, loaded)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    m.save(run / "checkpoints" / "step-00000003")
    (run / "latest").write_text("checkpoints/step-00000003\n")
    assert_same_model(m, XLSTMLanguageModel.from_pretrained(run))
    tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    save_file({**tensors, "blocks.5.norm.weight": torch.ones(32)}, str(tmp_path / "ours" / "model.safetensors"))
    with pytest.raises(XLSTMKitError, match="does not match the SHA-256"):  # our checkpoints' checksums count
        XLSTMLanguageModel.from_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "checksums.json").unlink()
    with pytest.raises(XLSTMKitError, match=r"model.safetensors does not match its config.json: unexpected "
                                            r"\['blocks.5.norm.weight'\] in model.safetensors"):
        XLSTMLanguageModel.from_pretrained(tmp_path / "ours")
    with pytest.raises(XLSTMKitError, match="HuggingFace has no model type"):
        m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_dtype_and_device_are_applied_per_tensor(tmp_path):
    m = large_model()
    m.save_pretrained(tmp_path / "f32")
    bf = XLSTMLanguageModel.from_pretrained(tmp_path / "f32", dtype=torch.bfloat16, device="cpu")
    for (name, p), ref in zip(bf.state_dict().items(), m.state_dict().values()):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu", name
        assert torch.equal(p, ref.to(torch.bfloat16)), name
        # its own storage, not a view into a whole-model buffer that would keep more memory alive
        assert p.untyped_storage().nbytes() == p.numel() * 2, name
    bf.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    again = XLSTMLanguageModel.from_pretrained(tmp_path / "bf16")  # dtype=None: the file's
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}
    f64 = XLSTMLanguageModel.from_pretrained(tmp_path / "f32", dtype="float64")
    assert {p.dtype for p in f64.parameters()} == {torch.float64}
    with pytest.raises(XLSTMKitError, match="dtype"):
        XLSTMLanguageModel.from_pretrained(tmp_path / "f32", dtype=torch.int32)
    with pytest.raises(XLSTMKitError, match="device"):
        XLSTMLanguageModel.from_pretrained(tmp_path / "f32", device="nonsense")


def test_bfloat16_load_keeps_no_float32_copy(tmp_path):
    """Peak resident memory of loading a float32 folder as bfloat16 stays near the bfloat16 size
    (one bf16 copy, one shard mapped at a time), far below float32 weights plus a bf16 copy."""
    m = XLSTMLanguageModel(large_config(d_model=512, n_blocks=12, n_heads=4, ffn_proj_factor=2.667, round_proj_to=64))
    n = m.num_parameters()
    m.save_pretrained(tmp_path / "m", max_shard_size="8MB")
    del m
    script = textwrap.dedent(f"""
        import resource, torch
        from xlstm_kit import XLSTMLanguageModel
        torch.zeros(1).to(torch.bfloat16)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = XLSTMLanguageModel.from_pretrained({str(tmp_path / "m")!r}, dtype=torch.bfloat16)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert {{p.dtype for p in m.parameters()}} == {{torch.bfloat16}}
        print((after - before) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    grown = int(out.stdout.split()[-1])
    bf16, f32 = 2 * n, 4 * n
    assert n > 30e6
    assert grown < bf16 + 2 * 8e6 + 40e6 < f32 + bf16, (grown / 1e6, bf16 / 1e6)


# ------------------------------------------------------------------------------------- bad folders
def _hf_folder(tmp_path, **kw):
    m = large_model(**kw)
    m.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", m


def test_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        XLSTMLanguageModel.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(XLSTMKitError, match="no config.json"):
        XLSTMLanguageModel.from_pretrained(tmp_path / "empty")
    folder, _ = _hf_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())

    (folder / "config.json").write_text(json.dumps({**cfg, "num_blocks": 3, "num_hidden_layers": 3}))
    with pytest.raises(XLSTMKitError, match=r"model.safetensors does not match its config.json: missing \['backbone.blocks.2"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "embedding_dim": 64}))
    with pytest.raises(XLSTMKitError, match=r"model.safetensors: backbone\.\S+ has shape \[\d+, \d+\], config.json implies \[\d+, \d+\]"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    with pytest.raises(XLSTMKitError, match="model_type 'mamba'"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(XLSTMKitError, match="not valid JSON"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))

    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "backbone.extra.weight": torch.ones(2)}, str(folder / "model.safetensors"))
    with pytest.raises(XLSTMKitError, match=r"unexpected weight 'backbone.extra.weight'"):
        XLSTMLanguageModel.from_pretrained(folder)
    save_file({**tensors, "backbone.blocks.0.mlstm_layer.q.weight": torch.zeros(16, 32, dtype=torch.int32)},
              str(folder / "model.safetensors"))
    with pytest.raises(XLSTMKitError, match="int32|I32|floating"):
        XLSTMLanguageModel.from_pretrained(folder)
    bad = dict(tensors)
    bad["backbone.blocks.1.ffn.proj_down.weight"] = bad["backbone.blocks.1.ffn.proj_down.weight"].clone()
    bad["backbone.blocks.1.ffn.proj_down.weight"][0, 0] = float("nan")
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(XLSTMKitError, match="NaN"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(XLSTMKitError, match="not a readable safetensors"):
        XLSTMLanguageModel.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        XLSTMLanguageModel.from_pretrained(folder)


def test_bad_shard_index_gives_clear_errors(tmp_path):
    m = large_model()
    folder = tmp_path / "many"
    m.save_pretrained(folder, max_shard_size="8KB")
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    (folder / shards[-1]).unlink()
    with pytest.raises(XLSTMKitError, match=f"lists the shard '{shards[-1]}'"):
        XLSTMLanguageModel.from_pretrained(folder)
    m.save_pretrained(folder, max_shard_size="8KB")
    values = list(index["weight_map"].values())
    key, where = next((k, v) for k, v in index["weight_map"].items() if values.count(v) > 1)
    other = next(s for s in shards if s != where)
    index_file.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], key: other}}))
    with pytest.raises(XLSTMKitError, match=f"{where} holds '{key}', which model.safetensors.index.json does not assign"):
        XLSTMLanguageModel.from_pretrained(folder)
    index_file.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], "backbone.norm_x.weight": where}}))
    with pytest.raises(XLSTMKitError, match=r"lists \['backbone.norm_x.weight'\], which its shards do not hold"):
        XLSTMLanguageModel.from_pretrained(folder)
    index_file.write_text("[]")
    with pytest.raises(XLSTMKitError, match="not a valid safetensors index"):
        XLSTMLanguageModel.from_pretrained(folder)


def test_save_pretrained_refuses_bad_arguments(tmp_path):
    m = large_model()
    with pytest.raises(XLSTMKitError, match="format"):
        m.save_pretrained(tmp_path / "x", format="gguf")
    with pytest.raises(XLSTMKitError, match="max_shard_size"):
        m.save_pretrained(tmp_path / "x", max_shard_size="lots")
    (tmp_path / "file").write_text("")
    with pytest.raises(XLSTMKitError, match="not a folder"):
        m.save_pretrained(tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert hub.parse_size("5GB") == 5 * 10**9 and hub.parse_size("2MiB") == 2 * 2**20 and hub.parse_size(123) == 123


# ------------------------------------------------------------------------------------- tokenizers
def make_tokenizer_json(path, vocab_size=VOCAB):
    """A small byte-level BPE tokenizer.json (tokenizers format) with <|endoftext|> = 0, <|pad|> = 1."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    text = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer."] * 20
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                             initial_alphabet=[], show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.save(str(path))
    return tok


def test_tokenizer_json_of_a_folder_prepends_bos(tmp_path):
    folder, m = _hf_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 0, "eos_token_id": 0}))
    raw = make_tokenizer_json(folder / "tokenizer.json")
    loaded = XLSTMLanguageModel.from_pretrained(folder)
    tok = loaded.tokenizer
    assert tok is loaded.hf_tokenizer and tok.bos_token_id == 0 and tok.eos_token_id == 0
    ids = tok.encode("to be")
    assert ids[0] == 0 and ids[1:] == raw.encode("to be", add_special_tokens=False).ids
    assert tok.decode(ids) == "to be"
    assert tok.vocab_size <= VOCAB and tok.name.startswith("hf-")
    lengths = tok.token_byte_lengths()
    assert lengths[0] == 0 and lengths[raw.token_to_id("t")] == 1
    assert isinstance(loaded.generate("to be", max_new_tokens=3, temperature=0), str)
    # it travels with the model: HF save (+ tokenizer_config.json), our save, and back
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "again" / "config.json").read_text())["bos_token_id"] == 0
    loaded.save(tmp_path / "ours")
    ours = XLSTMLanguageModel.load(tmp_path / "ours")
    assert ours.tokenizer_name is None and ours.tokenizer.bos_token_id == 0  # from tokenizer_config.json
    assert ours.tokenizer.encode("to be") == ids


def test_bos_comes_from_tokenizer_config_when_config_json_has_none(tmp_path):
    folder, _ = _hf_folder(tmp_path)
    make_tokenizer_json(folder / "tokenizer.json")
    assert XLSTMLanguageModel.from_pretrained(folder).tokenizer.bos_token_id is None  # nothing says which
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|endoftext|>"},
                                                              "eos_token": "<|pad|>"}))
    tok = XLSTMLanguageModel.from_pretrained(folder).tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 10_000}))
    with pytest.raises(XLSTMKitError, match="bos token id 10000 is not in its vocabulary"):
        XLSTMLanguageModel.from_pretrained(folder)


def test_a_folder_loads_without_the_tokenizers_package(tmp_path, monkeypatch):
    """Only encoding and decoding need `tokenizers` (an extra); they say which one is missing."""
    from xlstm_kit._extras import MissingExtraError

    folder, m = _hf_folder(tmp_path)
    make_tokenizer_json(folder / "tokenizer.json")

    def missing(module, feature):
        raise MissingExtraError(f"{feature} needs the extra: pip install 'xlstm-kit[gpt2]'")

    monkeypatch.setattr(tokenizers_mod, "require", missing)
    loaded = XLSTMLanguageModel.from_pretrained(folder)
    assert_same_model(m, loaded)
    with pytest.raises(MissingExtraError, match=r"tokenizer.json of a model folder needs the extra"):
        loaded.tokenizer.encode("to be")


def test_named_tokenizers_keep_working(tmp_path):
    """Our checkpoints' tokenizer.json names a tokenizer ({"name": "byte"}); an HF folder we write
    for such a model records the name in config.json instead (HF tools read tokenizer.json)."""
    m = large_model(vocab_size=256)
    m.tokenizer_name = "byte"
    m.save(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "tokenizer.json").read_text()) == {"name": "byte"}
    loaded = XLSTMLanguageModel.from_pretrained(tmp_path / "ours")
    assert loaded.tokenizer_name == "byte" and loaded.hf_tokenizer is None
    assert loaded.tokenizer.encode("ab") == [97, 98]
    loaded.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["xlstm_kit_tokenizer"] == "byte"
    assert XLSTMLanguageModel.from_pretrained(tmp_path / "hf").tokenizer_name == "byte"


def test_generation_stops_at_the_folders_end_tokens(tmp_path):
    """As transformers' generate: the eos_token_id (an id or a list) of generation_config.json
    when it sets one, else of config.json, ends a generation by default, token and text prompts
    alike; eos_token_id=[] turns that off, an explicit id replaces it."""
    folder, m = _hf_folder(tmp_path)
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(0))
    free = m.generate(prompt, 12, temperature=0)[7:].tolist()
    assert len(free) == 12 and len(set(free)) > 2  # the case under test: varied tokens
    a = free[5]
    b = next(t for t in free if t != a)
    cut = lambda ends: free[:next((n + 1 for n, t in enumerate(free) if t in ends), len(free))]  # noqa: E731
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": a}))
    loaded = XLSTMLanguageModel.from_pretrained(folder)
    assert loaded.generate(prompt, 12, temperature=0)[7:].tolist() == cut({a})
    assert len(cut({a})) < 12
    assert loaded.generate(prompt, 12, temperature=0, eos_token_id=[])[7:].tolist() == free
    assert loaded.generate(prompt, 12, temperature=0, eos_token_id=b)[7:].tolist() == cut({b})
    # text prompts (a tokenizer without an end token of its own) end there too
    tok = _IdTokenizer()
    text = loaded.generate([tok.decode(prompt.tolist())], 12, temperature=0, tokenizer=tok)[0]
    assert text == tok.decode(prompt.tolist() + [t for t in cut({a}) if t != a])
    # generation_config.json, when it sets end tokens, is what counts (a list here)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [b, VOCAB - 1]}))
    loaded = XLSTMLanguageModel.from_pretrained(folder)
    assert loaded.generate(prompt, 12, temperature=0)[7:].tolist() == cut({b, VOCAB - 1})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [b, VOCAB]}))
    with pytest.raises(XLSTMKitError, match="generation_config.json: eos_token_id"):
        XLSTMLanguageModel.from_pretrained(folder)


class _IdTokenizer:
    """Token i is the character chr(0x100 + i): any id sequence round-trips; no end token."""

    name = "ids"
    vocab_size = VOCAB
    eos_token_id = None

    def encode(self, text):
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids):
        return "".join(chr(0x100 + int(i)) for i in ids)
