"""The names the README showed before the package was layered keep working from their old paths
(thin re-export modules): `from xlstm_kit import XLSTMConfig, XLSTMLanguageModel` with the model's
I/O and generation methods, `xlstm_kit.model`, `xlstm_kit.train`, `xlstm_kit.data`,
`xlstm_kit.generate`, `xlstm_kit.checkpoint`, `xlstm_kit.errors`, `xlstm_kit.ops.dplr`."""
import torch


def test_old_module_paths_keep_their_public_names():
    import xlstm_kit
    from xlstm_kit import checkpoint, data, errors, generate, model, train
    from xlstm_kit.generation.generate import complete_texts
    from xlstm_kit.io import checkpoint as io_checkpoint
    from xlstm_kit.ops import dplr
    from xlstm_kit.training import data as training_data

    assert xlstm_kit.XLSTMLanguageModel is model.XLSTMLanguageModel
    assert xlstm_kit.XLSTMConfig is model.XLSTMConfig
    for name in ("TrainConfig", "train", "train_step", "TimeBudget", "lr_at", "continue_schedule"):
        assert callable(getattr(train, name)), name
    assert data.load_data is training_data.load_data
    assert generate.complete_texts is complete_texts
    for name in ("atomic_write", "save_model", "save_checkpoint", "resolve_checkpoint", "CheckpointError"):
        assert getattr(checkpoint, name) is getattr(io_checkpoint, name), name
    assert issubclass(errors.XLSTMKitError, ValueError)
    assert dplr.TRITON_LOG_DECAY_FLOOR < 0


def test_the_public_model_keeps_its_io_and_generation_methods(tmp_path):
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.models import XLSTMLanguageModel as PlainModel

    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1]))
    assert isinstance(m, PlainModel)  # the nn.Module of xlstm_kit.models, with methods over io/generation
    out = m.generate(torch.tensor(list(b"ab")), max_new_tokens=3, temperature=0)
    assert out.shape == (5,)
    m.save(tmp_path / "m", tokenizer="byte")
    loaded = XLSTMLanguageModel.load(tmp_path / "m")
    assert type(loaded) is XLSTMLanguageModel and loaded.tokenizer.name == "byte"
    assert loaded.generate("ab", max_new_tokens=3, temperature=0) == m.generate("ab", 3, temperature=0,
                                                                                tokenizer=loaded.tokenizer)
    assert type(XLSTMLanguageModel.from_pretrained(tmp_path / "m")) is XLSTMLanguageModel
