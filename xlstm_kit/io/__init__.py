"""Reading and writing models: our checkpoint and run-folder format (`checkpoint`), loading
(`loading`: our checkpoints and HuggingFace folders), the HuggingFace adapter of the large family
(`hf`), the converters to and from the official xlstm package (`compat`, `compat_large`) and the
tokenizers (`tokenizers`)."""
