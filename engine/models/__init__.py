"""engine.models: the decoder families and their loaders.

`decoder` is the common decoder (embedding, layers of attention + feed-forward, final norm, LM
head); each family module describes how its family differs; `loader`, `gguf_checkpoint` and
`source` turn a Hugging Face directory, a GGUF file or an embedded name into a loaded model.
"""
