"""Decoding: `generate` (token prompts, batches of any lengths, CUDA-graphed steps), `generate_text`
and `complete_texts` (text in, text out, stop strings, streaming), sampling (`sampling`) and
whole-character text streaming (`textstream`). It calls the models' public `step`; the models
never import it."""
